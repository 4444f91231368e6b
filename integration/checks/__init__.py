"""Checks against the outside world: a fresh install from the README's commands
(:mod:`.fresh_install`), laplace-torch's own test suite with ``DiagBackprop``
(:mod:`.laplace_suite`), the upstream patches (:mod:`.upstream.check`), and the BackPACK,
StochMan and data-parallel examples on the paper's U-Net."""
