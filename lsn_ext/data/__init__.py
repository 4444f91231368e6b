"""Data for tests, demos and benchmarks; nothing is downloaded.

- :func:`synthetic_lesions`: elliptic lesions on a textured background, made on the spot.
- :func:`lesion_dataset`: ISIC-like dermoscopy images (irregular, fuzzy-edged lesions, about
  1:8 class imbalance), standardised with fixed constants, made on the spot.
- :func:`load_nuclei` / :func:`nuclei_patches` / :func:`load_histology`: a real fluorescence
  nuclei image with its hand-drawn mask, and an H&E image as far out-of-distribution data,
  shipped with the package (``lsn_ext/data/nuclei_files/PROVENANCE.md``).
- :func:`load_nuclei_3d` / :func:`nuclei_volume_slices`: stardist's synthetic 3-D nuclei volume
  with its mask, and its z-slices as 2-D images, shipped beside them.
"""

from lsn_ext.data.nuclei import (
    NucleiSplits,
    histology_patches,
    load_histology,
    load_nuclei,
    load_nuclei_3d,
    nuclei_patches,
    nuclei_volume_slices,
    random_flips,
)
from lsn_ext.data.synthetic import lesion_dataset, synthetic_lesions

__all__ = [
    "NucleiSplits",
    "histology_patches",
    "lesion_dataset",
    "load_histology",
    "load_nuclei",
    "load_nuclei_3d",
    "nuclei_patches",
    "nuclei_volume_slices",
    "random_flips",
    "synthetic_lesions",
]
