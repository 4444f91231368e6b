"""The LSN paper's experiments at a scale that fits a 2-core CPU.

The experiments follow the 2023 arXiv version of the paper (Zepf et al., "Laplacian Segmentation
Networks: Improved Epistemic Uncertainty from Spatial Aleatoric Uncertainty", arXiv:2303.13123v1):
its Table 1 (IoU against loss reweighting), Table 2 (Pixel and Box Ratio of noise and black
boxes), Fig. 5 (aleatoric variance at the boundary) and Fig. 7 (entropy under distribution shift),
with Fig. 4 adapted (see ``report_fig4``). The 2024 version (MICCAI 2024, "Laplacian Segmentation
Networks Improve Epistemic Uncertainty Quantification") has no Box Ratio; it reports image-level
OOD detection AUROC instead, which is not reproduced here.

Seven models, by the paper's names: Ensemble, U-Net + Dropout, SSN (diag) + Dropout,
SSN + Dropout, U-Net + LA, LSN (diag) and LSN ("(diag)": rank-0 logit covariance), trained on

- ``lesions``: synthetic images, not ISIC: :func:`lsn_ext.data.lesion_dataset` generates
  ISIC-like 64×64 RGB images with a foreground share of about 1/9 (the paper's ISIC imbalance
  of about 1:8), and
- ``nuclei``: the fluorescence nuclei image (:func:`lsn_ext.data.nuclei_patches`), with the 31
  slices of stardist's synthetic 3-D nuclei volume as a second test set. Black is the
  background of a fluorescence image, so the black box is not out of distribution there.

Every network is trained for ``Budget.steps`` Adam steps (128: about 1.4 epochs of the lesions),
not to convergence, so each Laplace approximation is taken at weights that need not be a mode.

Parts (``--parts``, each separately selectable; trained networks and fitted posteriors are
cached in ``--cache``, so parts that share them train them once):

- ``table1``: IoU after training with BCE class-reweighting factors 1, 2, 4, 8 (lesions).
- ``table2``: Pixel Ratio and Box Ratio for noise and black boxes (LSN Eq. 16–17, §4.4).
- ``fig4``: average precision (PR-AUC) of the aleatoric against the epistemic map for finding the
  corrupted box pixels, SSN-based models (the paper's Fig. 4 instead compares the components'
  segmentations on clean images).
- ``fig5``: share of the aleatoric variance within 2 pixels of the mask boundary, against the
  share of pixels there.
- ``fig7``: per-image predictive entropy under blur, contrast, noise and intensity shifts of
  increasing strength, and the AUROC against in-distribution images per strength (lesions).
- ``diagnose``: why the aleatoric map is where it is (SSN loss variants, the map's definition),
  the prior precision (validation NLL on a wide grid, scalar and layer-wise marginal
  likelihood), the curvature estimator, and where the seed-to-seed spread comes from.

Every number is a mean over seeds with a 95 % t-interval. The report is written to
``integration/results/lsn_paper.md`` with the figures beside it and every table's per-seed
values in ``lsn_paper_per_seed.csv`` (data set, part, model, seed, metric, value); the cost
table gives each unit's wall-clock time as run. ``--quick`` runs a tiny version (tests) into a
temporary directory.

Run: ``./dev bench lsn_paper [--parts table1,table2] [--seeds 0-4] [--workers 2] [--quick]``
(or ``python -m integration.experiments.lsn_paper``). The package: :mod:`.design` (the seven
models), :mod:`.units` (the units of work), :mod:`.report` (the report) and ``__main__`` (the
command line); the shared code is :mod:`integration.experiments.kit`.
"""
