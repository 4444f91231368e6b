"""The experiment kit: what the experiments in ``integration/experiments/`` share.

- :mod:`.budget`: the sizes of a run (:class:`Budget`, :class:`ConvergedBudget` and their quick
  twins), :func:`parse_seeds`;
- :mod:`.data`: the ``lesions`` and ``nuclei`` splits, boxes, shifts, image statistics;
- :mod:`.training`: network specs, objectives, training with early stopping;
- :mod:`.cache`: networks, posteriors and results on disk, unit timings;
- :mod:`.posterior`: Laplace posteriors and their prior precisions;
- :mod:`.measures`: failure detection, calibration and their bootstrap over test images;
- :mod:`.demo_setting`: the demo's own setting, on :mod:`lsn_ext.demo`.

Every name is importable from the kit itself (``from integration.experiments.kit import
Budget, load_data``). The tables of the reports (intervals, formatting) are
:mod:`integration.experiments.tables`.
"""

from integration.experiments.kit.budget import (
    CONVERGED_FACTORS,
    CONVERGED_QUICK,
    QUICK,
    Budget,
    ConvergedBudget,
    parse_seeds,
)
from integration.experiments.kit.cache import Cache, ConvergedCache, cached_json, record_time
from integration.experiments.kit.data import (
    REGIONS,
    SHIFTS,
    Data,
    boxed,
    image_statistics,
    load_converged,
    load_data,
    loader,
    region_means,
    shift,
    volume_on_training_scale,
)
from integration.experiments.kit.demo_setting import demo_config, train_demo_ssn
from integration.experiments.kit.measures import (
    ECE_BINS,
    Pred,
    boot_image_metric,
    boot_pixel_metric,
    entropy_binary,
    foreground_entropy,
    histogram_edges,
    measure,
    measure_sets,
    shift_boot,
    spread,
)
from integration.experiments.kit.posterior import (
    fit_posterior,
    la_predict,
    laplace_posterior,
    marglik_prior,
    tune_priors,
)
from integration.experiments.kit.training import (
    EarlyStopping,
    NetSpec,
    build,
    hash_int,
    mean_logits,
    train,
    training_objective,
    validation_dice,
)

__all__ = [
    "CONVERGED_FACTORS",
    "CONVERGED_QUICK",
    "ECE_BINS",
    "QUICK",
    "REGIONS",
    "SHIFTS",
    "Budget",
    "Cache",
    "ConvergedBudget",
    "ConvergedCache",
    "Data",
    "EarlyStopping",
    "NetSpec",
    "Pred",
    "boot_image_metric",
    "boot_pixel_metric",
    "boxed",
    "build",
    "cached_json",
    "demo_config",
    "entropy_binary",
    "fit_posterior",
    "foreground_entropy",
    "hash_int",
    "histogram_edges",
    "image_statistics",
    "la_predict",
    "laplace_posterior",
    "load_converged",
    "load_data",
    "loader",
    "marglik_prior",
    "mean_logits",
    "measure",
    "measure_sets",
    "parse_seeds",
    "record_time",
    "region_means",
    "shift",
    "shift_boot",
    "spread",
    "train",
    "train_demo_ssn",
    "training_objective",
    "tune_priors",
    "validation_dice",
    "volume_on_training_scale",
]
