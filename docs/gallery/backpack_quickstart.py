"""
# BackPACK: DB and Monte-Carlo GGN diagonals

`examples/backpack_quickstart.py`: `extend` + `with backpack(DiagGGNExact())`, `DiagGGNMC` and
`DiagBackpropExtension()` on a network without skips; `convert` + `DiagBackpropExtension` on a
U-Net with `torch.cat` skips, beside lsn_ext's Monte-Carlo estimate; every diagonal against the
exact one (relative error, trace ratio per tensor), written as `diagonals.pt`,
`trace_ratios.png` and `summary.json`.

Below, the script runs as
`examples/backpack_quickstart.py --quick --out examples_out/gallery/backpack_quickstart`
would, when the site is built (tiny sizes: the numbers are not results). The script itself:

````python
--8<-- "examples/backpack_quickstart.py"
````
"""

# %%
# Run it at its `--quick` sizes, from the repository root.
import os
import runpy
import sys
from pathlib import Path

import matplotlib.pyplot as plt

NAME = "backpack_quickstart"
root = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pyproject.toml").is_file())
os.chdir(root)
out = f"examples_out/gallery/{NAME}"
sys.argv = [f"examples/{NAME}.py", "--quick", "--out", out]
runpy.run_path(sys.argv[0], run_name="__main__")

# %%
# The figures it wrote.
for path in sorted((root / out).glob("*.png")):
    image = plt.imread(path)
    fig = plt.figure(figsize=(image.shape[1] / 100, image.shape[0] / 100), dpi=100)
    fig.figimage(image)
