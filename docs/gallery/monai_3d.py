"""
# MONAI: a 3-D pipeline with sliding windows

`examples/monai_3d.py`: synthetic volumes written as NIfTI, MONAI dictionary transforms,
`monai.data.Dataset`/`DataLoader`, a `BasicUNet` trained with `DiceCELoss`; `Laplace` on
`lsn_ext.SelectInput(net, "image")` with `dict_key_x="image"`, `dict_key_y="label"`, marglik; maps
of a larger volume by `lsn_ext.predict(..., window=lsn_ext.SlidingWindow(...))`, saved as NIfTI
with the test image's affine, and a figure of its middle slice. Needs `lsn-ext[monai]`.

Below, the script runs as
`examples/monai_3d.py --quick --out examples_out/gallery/monai_3d`
would, when the site is built (tiny sizes: the numbers are not results). The script itself:

````python
--8<-- "examples/monai_3d.py"
````
"""

# %%
# Run it at its `--quick` sizes, from the repository root.
import os
import runpy
import sys
from pathlib import Path

import matplotlib.pyplot as plt

NAME = "monai_3d"
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
