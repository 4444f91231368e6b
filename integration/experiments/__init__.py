"""Paper-style experiments with seeds and intervals, each a script run as
``python -m integration.experiments.NAME`` (or ``./dev bench NAME``) that writes a report to
``integration/results/``. What they share is in :mod:`.kit` (data, budgets, training with early
stopping, caching, posterior fits, measures) and :mod:`.tables` (intervals over seeds and the
report's formatting); no experiment imports another."""
