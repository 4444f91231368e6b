"""lsn_ext's integration scripts, by role (``integration/README.md``).

- :mod:`integration.benchmarks`: time, memory and accuracy of the estimators (``bench_*``);
- :mod:`integration.experiments`: paper-style experiments with seeds and intervals, on one
  experiment kit (:mod:`integration.experiments.kit`) and one tables module
  (:mod:`integration.experiments.tables`);
- :mod:`integration.checks`: the installation, laplace-torch's own test suite, the upstream
  patches and the BackPACK / StochMan / distributed examples;
- :mod:`integration.harness`: what every role shares (the machine line, the unit runner, memory
  counters and timing).

Every script runs from the repository root as ``python -m integration.<role>.<name>`` or
``./dev bench <name>``; the reports are written to ``integration/results/``.
"""
