"""Data for tests, demos and benchmarks; nothing is downloaded.

- :func:`synthetic_lesions`: elliptic lesions on a textured background, made on the spot.
- :func:`load_nuclei` / :func:`nuclei_patches` / :func:`load_histology`: a real fluorescence
  nuclei image with its hand-drawn mask, and an H&E image as far out-of-distribution data,
  shipped with the package (``lsn_ext/data/nuclei/PROVENANCE.md``).
"""

from lsn_ext.data.nuclei import (
    NucleiSplits,
    histology_patches,
    load_histology,
    load_nuclei,
    nuclei_patches,
    random_flips,
)
from lsn_ext.data.synthetic import synthetic_lesions

__all__ = [
    "NucleiSplits",
    "histology_patches",
    "load_histology",
    "load_nuclei",
    "nuclei_patches",
    "random_flips",
    "synthetic_lesions",
]
