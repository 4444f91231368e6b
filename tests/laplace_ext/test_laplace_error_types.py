"""DiagBackprop raises the exception types laplace-torch's own backends raise (issue 25).

For each misuse, the same call is made with laplace-torch's ``CurvlinopsGGN`` (its default
backend) and ``BackPackGGN`` as references, then with ``DiagBackprop`` (both estimators): where a
reference raises, DiagBackprop must raise an instance of the same type, so code that catches
laplace-torch's errors keeps working when DiagBackprop replaces its backend. Where lsn_ext's
message is its own (target checks), the error is of both lsn_ext's type (``ValueError``) and
torch's (``RuntimeError`` / ``IndexError``, see :mod:`lsn_ext.rules.losses`).

A reference that does not raise for a misuse is left out of that misuse's pairs (BackPACK
accepts ``[N, 1]`` class targets, and laplace-torch refuses dictionary batches for BackPACK
before the backend runs); ``test_each_listed_reference_raises`` keeps that list honest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from laplace import Laplace
from laplace.curvature import BackPackGGN, CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, SelectInput
from lsn_ext.rules.losses import TargetDtypeError, TargetRangeError, TargetShapeError

REFERENCES = (CurvlinopsGGN, BackPackGGN)
ESTIMATORS = ("mc", "db")

# torch's MSELoss warns about the broadcast before the reference backends raise
pytestmark = pytest.mark.filterwarnings("ignore:Using a target size:UserWarning")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _x(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(1))


def _fit(likelihood: str, y: torch.Tensor, model: nn.Module | None = None, **kw) -> None:
    la = Laplace(
        _net() if model is None else model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="diag",
        **kw,
    )
    la.fit(DataLoader(TensorDataset(_x(), y), batch_size=3))


def _fit_dict(keys: tuple[str, str], **kw) -> None:
    x = _x()
    data = [{keys[0]: x[i], keys[1]: torch.tensor(i % 2)} for i in range(6)]
    la = Laplace(
        SelectInput(_net(), "input_ids"),
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        **kw,
    )
    la.fit(DataLoader(data, batch_size=3))


def _frozen() -> nn.Module:
    net = _net()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


@dataclass(frozen=True)
class Misuse:
    """One misuse: ``run(backend, **backend_kwargs)`` makes it with that backend."""

    name: str
    run: Callable[..., None]
    references: tuple[type, ...] = REFERENCES


def _laplace(backend, kwargs):
    return {"backend": backend, "backend_kwargs": kwargs}


MISUSES = (
    Misuse(
        "unknown-likelihood",
        lambda b, **k: _fit("segmentation", torch.zeros(6, dtype=torch.long), **_laplace(b, k)),
    ),
    Misuse("unknown-likelihood-backend", lambda b, **k: b(_net(), "segmentation", **k)),
    Misuse("unknown-backend-option", lambda b, **k: b(_net(), "classification", foo=1, **k)),
    Misuse(
        "float-class-targets",
        lambda b, **k: _fit("classification", torch.rand(6), **_laplace(b, k)),
    ),
    Misuse(
        "class-targets-N-by-1",
        lambda b, **k: _fit(
            "classification", torch.zeros(6, 1, dtype=torch.long), **_laplace(b, k)
        ),
        references=(CurvlinopsGGN,),
    ),
    Misuse(
        "class-target-out-of-range",
        lambda b, **k: _fit("classification", torch.full((6,), 5), **_laplace(b, k)),
    ),
    Misuse(
        "regression-targets-wrong-width",
        lambda b, **k: _fit("regression", torch.randn(6, 3), **_laplace(b, k)),
    ),
    Misuse(
        "regression-targets-without-output-axis",
        lambda b, **k: _fit("regression", torch.randn(6), **_laplace(b, k)),
    ),
    Misuse(
        "dict-batch-without-dict_key_y",
        lambda b, **k: _fit_dict(("input_ids", "label"), **_laplace(b, k)),
        references=(CurvlinopsGGN,),
    ),
    Misuse(
        "dict-batch-without-dict_key_x",
        lambda b, **k: _fit_dict(("image", "labels"), **_laplace(b, k)),
        references=(CurvlinopsGGN,),
    ),
    Misuse(
        "list-inputs",
        lambda b, **k: b(_net(), "classification", **k).diag(
            [_x()], torch.zeros(6, dtype=torch.long)
        ),
    ),
    Misuse(
        "all-parameters-frozen",
        lambda b, **k: _fit(
            "classification", torch.zeros(6, dtype=torch.long), _frozen(), **_laplace(b, k)
        ),
        references=(CurvlinopsGGN,),
    ),
)

PAIRS = [
    pytest.param(m, ref, est, id=f"{m.name}-vs-{ref.__name__}-{est}")
    for m in MISUSES
    for ref in m.references
    for est in ESTIMATORS
]


def _error_of(run: Callable[[], None]) -> Exception:
    try:
        run()
    except Exception as err:
        return err
    pytest.fail("the misuse raised no error")


@pytest.mark.parametrize(("misuse", "reference", "estimator"), PAIRS)
def test_diag_backprop_raises_the_reference_backends_type(misuse, reference, estimator):
    expected = type(_error_of(lambda: misuse.run(reference)))
    got = _error_of(lambda: misuse.run(DiagBackprop, estimator=estimator))
    assert isinstance(got, expected), f"{reference.__name__} raises {expected.__name__}: {got!r}"


@pytest.mark.parametrize("misuse", MISUSES, ids=lambda m: m.name)
def test_each_listed_reference_raises(misuse):
    for reference in misuse.references:
        _error_of(lambda reference=reference: misuse.run(reference))


@pytest.mark.parametrize(
    ("name", "error", "also"),
    [
        ("float-class-targets", TargetDtypeError, RuntimeError),
        ("class-target-out-of-range", TargetRangeError, IndexError),
        ("regression-targets-wrong-width", TargetShapeError, RuntimeError),
        ("class-targets-N-by-1", TargetShapeError, RuntimeError),
    ],
)
def test_target_errors_are_value_errors_with_lsn_ext_messages(name, error, also):
    misuse = next(m for m in MISUSES if m.name == name)
    got = _error_of(lambda: misuse.run(DiagBackprop))
    assert type(got) is error
    assert isinstance(got, ValueError)
    assert isinstance(got, also)
    assert "target" in str(got)


def test_class_targets_N_by_1_message_offers_no_layout_it_refuses():
    misuse = next(m for m in MISUSES if m.name == "class-targets-N-by-1")
    message = str(_error_of(lambda: misuse.run(DiagBackprop)))
    assert "must be class indices of shape (3,) for logits (3, 2); got (3, 1)" in message
