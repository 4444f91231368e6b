"""The upstream patches for StochMan, BackPACK and laplace-torch, and their offline check
(:mod:`.check`; ``README.md`` here)."""
