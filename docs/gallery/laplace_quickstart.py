"""
# laplace-torch on a 2-D U-Net

`examples/laplace_quickstart.py`: a `lsn_ext.models.UNet` trained on synthetic discs and squares,
`Laplace(..., backend=lsn_ext.DiagBackprop)`, `fit`, `optimize_prior_precision(method="marglik")`
and the per-pixel maps of `lsn_ext.predict` (predictive mean, entropy, mutual information,
variance), written as `uncertainty.png`, `maps.npz` and `summary.json`.

Below, the script runs as
`examples/laplace_quickstart.py --quick --out examples_out/gallery/laplace_quickstart`
would, when the site is built (tiny sizes: the numbers are not results). The script itself:

````python
--8<-- "examples/laplace_quickstart.py"
````
"""

# %%
# Run it at its `--quick` sizes, from the repository root.
import os
import runpy
import sys
from pathlib import Path

import matplotlib.pyplot as plt

NAME = "laplace_quickstart"
root = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pyproject.toml").is_file())
os.chdir(root)
out = f"examples_out/gallery/{NAME}"
sys.argv = [f"examples/{NAME}.py", "--quick", "--no-progress", "--out", out]
runpy.run_path(sys.argv[0], run_name="__main__")

# %%
# The figures it wrote.
for path in sorted((root / out).glob("*.png")):
    image = plt.imread(path)
    fig = plt.figure(figsize=(image.shape[1] / 100, image.shape[0] / 100), dpi=100)
    fig.figimage(image)
