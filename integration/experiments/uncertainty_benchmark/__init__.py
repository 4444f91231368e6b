"""Failure detection and calibration of segmentation uncertainty, with converged networks.

Nine uncertainty methods on the LSN paper's two data sets (``lesions``, ``nuclei``; see
``integration/experiments/lsn_paper/``; the data, networks, posteriors, cache and corruptions
are the experiment kit's, :mod:`integration.experiments.kit`): the MAP U-Net's own entropy, MC
dropout, a deep ensemble, a diagonal Laplace approximation on the U-Net and the LSN (rank 10
and rank 0), the last two each with the sampling (``nn``) and the linearised (``glm``)
predictive. Every network is trained with early
stopping on validation Dice.

Measured, per data set and seed:

- pixels (clean test images): AUROC and AUPRC of the predictive entropy for "pixel
  misclassified", ECE (15 bins), NLL and Brier score of ``E p``;
- images: AURC, oracle AURC and E-AURC of the per-image uncertainty for the risk ``1 − Dice``,
  and Spearman's correlation of that uncertainty with Dice;
- shift: AUROC of the per-image uncertainty for clean against shifted test images (lesions:
  the four corruptions of ``kit.SHIFTS`` at their middle strength; nuclei: the 2-D test
  patches against the 3-D volume's slices), also for a model-free image-statistics score, and
  the pixel AUROC and AURC on the shifted images;
- the Box Ratio of the epistemic variance for a noise box (the LSN paper's Table 2).

Statistics: mean ± 95 % t-interval over seeds, a bootstrap interval over test images, and
paired per-seed differences against the MAP entropy and the ensemble.

Run: ``./dev bench uncertainty_benchmark [--quick] [--seeds 0-4] [--datasets lesions,nuclei]
[--workers 2] [--cache DIR] [--out DIR] [--report-only]`` (or ``python -m
integration.experiments.uncertainty_benchmark``). Writes ``integration/results/uncertainty.md``,
``uncertainty_per_seed.csv`` and ``uncertainty_risk_coverage.png``. The package:
:mod:`.design` (the methods), :mod:`.units` (one data set and seed), :mod:`.report` and
``__main__`` (the command line).
"""
