"""The demo's own setting (``lsn-ext demo``) for the experiments that measure it: its
configuration with its quick sizes, and its SSN trained with a chosen loss.

Built on :mod:`lsn_ext.demo` (its :class:`~lsn_ext.demo.DemoConfig`,
:func:`~lsn_ext.demo.quick_settings`, :func:`~lsn_ext.demo.ssn_objective` and
:func:`~lsn_ext.demo.train`), so that the demo and these experiments train the same networks;
:mod:`lsn_ext.demo` itself imports nothing from here.
"""

from __future__ import annotations

import functools

from lsn_ext.demo import DemoConfig, DemoData, quick_settings, ssn_objective, train
from lsn_ext.models import SSN


def demo_config(quick: bool, **settings: object) -> DemoConfig:
    """The demo's settings with ``settings``, no progress bars and torch's own thread count;
    ``quick``: the demo's tiny data and :func:`~lsn_ext.demo.quick_settings` (one epoch,
    widths 4-8, rank at most 2, few samples)."""
    cfg = DemoConfig(progress=False, threads=None, quick=quick, **settings)
    if quick:
        for name, value in quick_settings(cfg).items():
            setattr(cfg, name, value)
    return cfg


def train_demo_ssn(
    cfg: DemoConfig, data: DemoData, seed: int, loss: str = "logsumexp", n_samples: int = 20
) -> SSN:
    """The demo's SSN (rank ``cfg.rank``, float32) trained on ``data`` for ``cfg.epochs`` with
    the SSN loss ``loss`` (``"logsumexp"``: LSN Eq. 11, or ``"expected"``) of ``n_samples``
    logit samples."""
    ssn = SSN.with_unet(1, widths=cfg.widths, rank=cfg.rank).float()
    objective = functools.partial(ssn_objective, objective=loss, n_samples=n_samples)
    return train("SSN", ssn, objective, data.train_x, data.train_y, cfg, seed)
