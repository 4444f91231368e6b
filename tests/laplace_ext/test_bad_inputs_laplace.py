"""Bad inputs to the laplace-torch glue, the predictives, VI and the LSN helpers.

Every case calls one public entry point with something a careful user might get wrong (NaN/inf
inputs or targets, wrong shapes or dtypes, empty loaders or batches, unfitted objects,
training-mode models, bad option values) and asserts either the correct result or a clear
error (type and message), and that the model is unchanged (:mod:`tests.model_state`: parameters,
buffers, modes, ``.grad``, hooks, attributes). Every parameter gets a ``.grad`` before the
snapshot, so clearing or accumulating gradients is caught.

laplace-torch's own ``Laplace.fit`` (not lsn_ext) sets ``model.output_size``, calls
``model.eval()`` and ``model.zero_grad()`` before it reaches the backend; cases marked
``laplace_fit`` allow exactly these three differences. The other cases allow none.

Cases named ``upstream-*`` record errors that laplace-torch raises before lsn_ext's backend
exists (it is built lazily, on the first batch of ``fit``), with laplace-torch's own message:
the README's table "Errors raised by laplace-torch before the backend runs" gives their remedies.
If one of them starts failing, laplace-torch has changed: update that table. The tests at the end
record what laplace-torch's ``fit`` and ``la(x, pred_type="nn")`` do to the model, and check the
remedies the README gives for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec

import pytest
import torch
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import DiagBackprop, VariationalPosterior, bridge_predictive
from lsn_ext.estimators import ggn_diagonal
from lsn_ext.exact import mc_ggn_diagonal
from lsn_ext.laplace_ext.checks import check_before_laplace_fit
from lsn_ext.laplace_ext.gridsearch import gridsearch_prior_precision
from lsn_ext.laplace_ext.predictive import predict
from lsn_ext.lsn import (
    aleatoric_maps,
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    predict_lsn,
)
from lsn_ext.models.ssn import SSN, ssn_loss
from tests.model_state import differences, snapshot

NAN, INF = float("nan"), float("inf")
# More samples than any machine's memory holds (torch's allocator used to answer, nameless).
HUGE = 10**12
F64 = torch.float64  # the cases are built at import, before conftest's float64 default


# -- builders -----------------------------------------------------------------------------------


def _net(C: int = 2, *, bn: bool = True, dropout: float = 0.0, flat: bool = False) -> nn.Module:
    """A small segmentation network ``[N, 2, 6, 6] → [N, C, 6, 6]`` in eval mode."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(2, 3, 3, padding=1)]
    if bn:
        layers.append(nn.BatchNorm2d(3))
    layers.append(nn.Tanh())
    if dropout:
        layers.append(nn.Dropout2d(dropout))
    layers.append(nn.Conv2d(3, C, 1))
    if flat:
        layers.append(nn.Flatten())
    net = nn.Sequential(*layers).double().eval()
    if bn:  # non-trivial running statistics, so that an update would show
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    return net


def _x(n: int = 4) -> Tensor:
    return torch.randn(n, 2, 6, 6, generator=torch.Generator().manual_seed(1), dtype=F64)


def _y(kind: str = "ce", n: int = 4, C: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(2)
    if kind == "ce":
        return torch.randint(0, C, (n, 6, 6), generator=g)
    if kind == "bce":
        return (torch.rand(n, 1, 6, 6, generator=g) > 0.5).double()
    return torch.randn(n, C * 36, generator=g, dtype=F64)  # flat regression


def _loader(x: Tensor, y: Tensor, batch_size: int = 2) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _laplace(model: nn.Module, likelihood: str = "classification", **backend_kwargs) -> Laplace:
    return Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs=backend_kwargs,
    )


def _fitted(loss: str = "ce", C: int = 2, **kwargs) -> tuple[nn.Module, Laplace]:
    if loss == "mse":
        net = _net(C, flat=True)
        la = _laplace(net, "regression", **kwargs)
    else:
        net = _net(1 if loss == "bce" else C)
        la = _laplace(net, loss=loss, **kwargs)
    la.fit(_loader(_x(), _y(loss, C=C)))
    return net, la


def _ssn() -> SSN:
    torch.manual_seed(0)
    return SSN.with_unet(2, num_classes=1, widths=(3, 4), rank=2).double().eval()


def _ssn_data(n: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 2, 8, 8, generator=g, dtype=F64)
    return x, (torch.rand(n, 1, 8, 8, generator=g, dtype=F64) > 0.5).double()


# -- cases --------------------------------------------------------------------------------------

Call = Callable[[], object]


@dataclass
class Case:
    """``prepare() -> (model to check, call)``; then ``error`` = ``(type, match)`` or ``check``."""

    prepare: Callable[[], tuple[nn.Module, Call]]
    error: tuple[type[Exception], str] | None = None
    check: Callable[[object], None] | None = None
    laplace_fit: bool = False  # laplace-torch's fit runs inside the call (see module doc)


def _raises(exc: type[Exception], match: str) -> dict:
    return {"error": (exc, match)}


def _fit_case(
    loss: str = "ce",
    x: Tensor | None = None,
    y: Tensor | None = None,
    *,
    model: nn.Module | None = None,
    likelihood: str = "classification",
    asdl: dict | None = None,
    **backend_kwargs,
) -> Callable[[], tuple[nn.Module, Call]]:
    """Fit a DiagBackprop Laplace on ``(x, y)`` inside the call."""

    def prepare():
        net = model if model is not None else _net(1 if loss == "bce" else 2)
        la = Laplace(
            net, likelihood, subset_of_weights="all", hessian_structure="diag",
            backend=DiagBackprop, backend_kwargs={"loss": loss, **backend_kwargs},
            asdl_fisher_kwargs=asdl,
        )  # fmt: skip
        xs = _x() if x is None else x
        ys = _y(loss) if y is None else y
        return net, lambda: la.fit(_loader(xs, ys))

    return prepare


def _nan_at(t: Tensor, value: float = NAN) -> Tensor:
    t = t.clone()
    t.view(-1)[3] = value
    return t


class _DictNet(nn.Module):
    """A model that takes laplace-torch's dictionary batches whole."""

    def __init__(self):
        super().__init__()
        self.net = _net(2)

    def forward(self, batch):
        return self.net(batch["input_ids"] if isinstance(batch, dict) else batch)


class _DictLoader:
    dataset = (0, 1)

    def __iter__(self):
        yield {"input_ids": _x(2), "labels": _y("ce", 2)}


def _fit_dict():
    model = _DictNet().eval()
    la = _laplace(model)
    return model, lambda: la.fit(_DictLoader())


def _train_mode_fit():
    net = _net(2).train()
    la = _laplace(net, loss="ce")

    def call():
        la.fit(_loader(_x(), _y()))
        return la

    return net, call


def _check_train_mode_fit(la) -> None:
    # laplace-torch's fit put the model in eval mode (its doing); the curvature is finite.
    assert not la.model.training
    assert torch.isfinite(la.H).all()


def _with_fitted(loss: str, call: Callable[[Laplace], object], **kwargs):
    def prepare():
        net, la = _fitted(loss, **kwargs)
        return net, lambda: call(la)

    return prepare


def _train_mode(loss: str, call: Callable[[Laplace], object]):
    def prepare():
        net, la = _fitted(loss)
        net.train()
        return net, lambda: call(la)

    return prepare


def _unfitted(call: Callable[[Laplace], object]):
    def prepare():
        net = _net(2)
        return net, lambda: call(_laplace(net))

    return prepare


def _loaded_without_loss(call: Callable[[Laplace], object]):
    def prepare():
        net, la = _fitted("bce")
        wrong = _laplace(net)  # created without backend_kwargs={"loss": "bce"}
        wrong.load_state_dict(la.state_dict())
        return net, lambda: call(wrong)

    return prepare


def _gs(y: Tensor | None = None, x: Tensor | None = None, loss: str = "ce", **kwargs):
    def call(la):
        xs = _x() if x is None else x
        ys = _y(loss) if y is None else y
        return gridsearch_prior_precision(
            la, _loader(xs, ys), **{"grid": [0.1, 10.0], "n_samples": 2, **kwargs}
        )

    return _with_fitted(loss, call)


def _gs_prior_restored(y: Tensor):
    """A failing grid search leaves the prior precision as it was."""

    def prepare():
        net, la = _fitted("ce")
        la.prior_precision = 3.0

        def call():
            try:
                gridsearch_prior_precision(la, _loader(_x(), y), grid=[0.1, 10.0], n_samples=2)
            finally:
                assert float(la.prior_precision) == 3.0
            return la

        return net, call

    return prepare


def _check_grid_result(result) -> None:
    assert result.prior_precision in result.grid
    assert all(math.isfinite(s) for s in result.scores)


def _with_255(y: Tensor) -> Tensor:
    y = y.clone()
    y[:, 0] = 255
    return y


def _vi(**kwargs):
    def prepare():
        net = _net(2)
        return net, lambda: VariationalPosterior(net, "ce", **kwargs)

    return prepare


def _vi_call(call: Callable[[VariationalPosterior], object], *, train: bool = False, **kwargs):
    def prepare():
        net = _net(2)
        vi = VariationalPosterior(net, "ce", rank=1, init_std=0.05, **kwargs)
        if train:
            net.train()
        return net, lambda: call(vi)

    return prepare


def _vi_fit(batches=None, **kwargs):
    def call(vi):
        data = [(_x(2), _y("ce", 2))] if batches is None else batches
        return vi.fit(data, **{"epochs": 1, **kwargs})

    return call


def _check_vi_fitted(vi) -> None:
    assert len(vi.history) == 2
    assert all(math.isfinite(v) for v in vi.history)


def _frozen_vi():
    net = _net(2)
    for p in net.parameters():
        p.requires_grad_(False)
    return net, lambda: VariationalPosterior(net, "ce")


def _check_prediction(pred) -> None:
    assert torch.isfinite(pred.mean).all()
    torch.testing.assert_close(pred.mean.sum(1), torch.ones_like(pred.mean[:, 0]))
    assert (pred.variance >= 0).all()


def _check_binary_prediction(pred) -> None:
    assert pred.mean.shape[1] == 1
    assert ((pred.mean > 0) & (pred.mean < 1)).all()
    assert (pred.variance >= 0).all()


def _lsn(call: Callable[[SSN, Laplace, Tensor], object], *, train: bool = False):
    def prepare():
        ssn = _ssn()
        x, y = _ssn_data()
        la = fit_lsn(ssn, _loader(x, y), estimator="db")
        ssn.train(train)
        return ssn, lambda: call(ssn, la, x)

    return prepare


def _ssn_call(call: Callable[[SSN, Tensor], object]):
    def prepare():
        ssn = _ssn()
        return ssn, lambda: call(ssn, _ssn_data()[0])

    return prepare


def _fit_lsn_call(loader_of: Callable[[], object], **kwargs):
    def prepare():
        ssn = _ssn()
        return ssn, lambda: fit_lsn(ssn, loader_of(), **kwargs)

    return prepare


def _frozen_ssn_fit():
    def prepare():
        ssn = _ssn().requires_grad_(False)
        return ssn, lambda: fit_lsn(ssn, _loader(*_ssn_data()))

    return prepare


def _channels_last_ssn_fit():
    def prepare():
        ssn = _ssn().to(memory_format=torch.channels_last)
        return ssn, lambda: fit_lsn(ssn, _loader(*_ssn_data()))

    return prepare


def _plain(model_of: Callable[[], nn.Module], call: Callable[[nn.Module], object]):
    def prepare():
        model = model_of()
        return model, lambda: call(model)

    return prepare


def _bce_nan() -> Tensor:
    return _nan_at(_y("bce"))


def _frozen_net() -> nn.Module:
    net = _net(2)
    net.requires_grad_(False)
    return net


def _parameterless_net() -> nn.Module:
    return nn.Sequential(nn.Tanh()).double().eval()


def _channels_last_net() -> nn.Module:
    return _net(2).to(memory_format=torch.channels_last)


def _no_batches() -> DataLoader:
    """One sample, ``batch_size=2``, ``drop_last=True``: a non-empty dataset but no batch."""
    return DataLoader(TensorDataset(_x(1), _y("ce", 1)), batch_size=2, drop_last=True)


def _upstream_fit(model_of: Callable[[], nn.Module], loader_of=None, **laplace_kwargs):
    """``Laplace(model, ..., backend=DiagBackprop, **laplace_kwargs).fit(loader)`` in the call."""

    def prepare():
        net = model_of()

        def call():
            kwargs = {"subset_of_weights": "all", "hessian_structure": "diag", **laplace_kwargs}
            la = Laplace(net, "classification", backend=DiagBackprop, **kwargs)
            la.fit(_loader(_x(), _y()) if loader_of is None else loader_of())
            return la

        return net, call

    return prepare


def _under_inference_mode(call: Callable[[], object]) -> object:
    with torch.inference_mode():
        return call()


def _fit_under_inference_mode():
    net, call = _upstream_fit(_net)()
    return net, lambda: _under_inference_mode(call)


# laplace-torch checks for asdfghjkl before anything else; with it installed, its fit reaches
# DiagBackprop.eig_lowrank, which fits (lsn_ext.lowrank.LowRankGGNLaplace needs no asdfghjkl).
_LOWRANK_ERROR = (
    _raises(ImportError, "please install the old asdfghjkl")
    if find_spec("asdfghjkl") is None
    else {"check": lambda _: None}
)


CASES: dict[str, Case] = {
    # -- DiagBackprop through Laplace(...).fit --------------------------------------------------
    "fit-nan-inputs": Case(
        _fit_case(x=_nan_at(_x())),
        **_raises(ValueError, "inputs.*NaN or infinite"),
        laplace_fit=True,
    ),
    "fit-inf-inputs": Case(
        _fit_case(x=_nan_at(_x(), INF)),
        **_raises(ValueError, "NaN or infinite"),
        laplace_fit=True,
    ),
    "fit-nan-bce-targets": Case(
        _fit_case("bce", y=_bce_nan()),
        **_raises(ValueError, "targets.*NaN or infinite"),
        laplace_fit=True,
    ),
    "fit-float-ce-targets": Case(
        _fit_case(y=_y().double()),
        **_raises(ValueError, "integer class indices"),
        laplace_fit=True,
    ),
    "fit-ce-target-out-of-range": Case(
        _fit_case(y=_y() + 5), **_raises(ValueError, r"outside \[0, 2\)"), laplace_fit=True
    ),
    "fit-bce-targets-wrong-shape": Case(
        _fit_case("bce", y=_y("bce")[:, :, :3]),
        **_raises(ValueError, "do not match"),
        laplace_fit=True,
    ),
    "fit-dict-batches": Case(
        _fit_dict,
        **_raises(
            ValueError,
            r"dictionary batch \(keys \['input_ids', 'labels'\]\) for a _DictNet.*SelectInput",
        ),
        laplace_fit=True,
    ),
    "fit-asdl-fisher-kwargs": Case(
        _fit_case(asdl={"n_mc_samples": 3}),
        **_raises(TypeError, "asdl_fisher_kwargs"),
        laplace_fit=True,
    ),
    "fit-stochastic-false": Case(
        _fit_case(stochastic=False),
        **_raises(ValueError, "exact GGN.*estimator='db'"),
        laplace_fit=True,
    ),
    "fit-stochastic-true-with-db": Case(
        _fit_case(stochastic=True, estimator="db"),
        **_raises(ValueError, "contradicts"),
        laplace_fit=True,
    ),
    "fit-stochastic-not-bool": Case(
        _fit_case(stochastic="yes"),
        **_raises(TypeError, "stochastic must be a bool"),
        laplace_fit=True,
    ),
    "fit-num-samples-disagree": Case(
        _fit_case(num_samples=2, mc_samples=3),
        **_raises(ValueError, "disagree"),
        laplace_fit=True,
    ),
    "fit-num-samples-with-db": Case(
        _fit_case(num_samples=4, estimator="db"),
        **_raises(ValueError, "draws no Monte-Carlo"),
        laplace_fit=True,
    ),
    "fit-zero-mc-samples": Case(
        _fit_case(mc_samples=0),
        **_raises(ValueError, "mc_samples must be a positive int"),
        laplace_fit=True,
    ),
    "fit-unknown-estimator": Case(
        _fit_case(estimator="kfac"),
        **_raises(ValueError, "unknown estimator 'kfac'"),
        laplace_fit=True,
    ),
    "fit-shrinkage-out-of-range": Case(
        _fit_case(estimator="db_calibrated", shrinkage=2.0),
        **_raises(ValueError, "shrinkage must lie in"),
        laplace_fit=True,
    ),
    "fit-float-seed": Case(
        _fit_case(seed=1.5),
        **_raises(TypeError, "seed must be an int or None"),
        laplace_fit=True,
    ),
    "fit-bad-ce-first-step": Case(
        _fit_case(ce_first_step="full"),
        **_raises(ValueError, "ce_first_step"),
        laplace_fit=True,
    ),
    "fit-dense-regression": Case(
        _fit_case("mse", y=torch.randn(4, 2, 6, 6, dtype=F64), likelihood="regression"),
        **_raises(ValueError, r"n_outputs=6.*nn\.Flatten"),
        laplace_fit=True,
    ),
    "fit-ce-on-one-channel": Case(
        _fit_case(model=_net(1)),
        **_raises(ValueError, "one logit channel.*'bce'"),
        laplace_fit=True,
    ),
    "fit-bce-with-regression": Case(
        _fit_case("bce", likelihood="regression"),
        **_raises(ValueError, "does not fit"),
        laplace_fit=True,
    ),
    "fit-train-mode-model": Case(_train_mode_fit, check=_check_train_mode_fit, laplace_fit=True),
    "fit-inference-mode": Case(
        _fit_under_inference_mode,
        **_raises(RuntimeError, r"under torch\.inference_mode\(\).*outside the inference_mode"),
        laplace_fit=True,
    ),
    # -- laplace-torch's own errors before the backend exists (README table) -------------------
    "upstream-fit-all-frozen": Case(
        _upstream_fit(_frozen_net),
        **_raises(ValueError, r"torch\.cat\(\): expected a non-empty list of Tensors"),
        laplace_fit=True,
    ),
    "upstream-fit-no-parameters": Case(
        _upstream_fit(_parameterless_net), error=(StopIteration, "^$"), laplace_fit=True
    ),
    "upstream-fit-loader-without-batches": Case(
        _upstream_fit(_net, _no_batches), error=(StopIteration, "^$"), laplace_fit=True
    ),
    "upstream-fit-channels-last": Case(
        _upstream_fit(_channels_last_net),
        **_raises(RuntimeError, "view size is not compatible with input tensor's size and stride"),
        laplace_fit=True,
    ),
    "upstream-last-layer-on-a-unet": Case(  # laplace-torch fits a deep copy: model untouched
        _upstream_fit(_net, subset_of_weights="last_layer"),
        **_raises(ValueError, r"Use model with a linear last layer\."),
    ),
    "upstream-marglik-inference-mode": Case(
        _with_fitted(
            "ce",
            lambda la: _under_inference_mode(
                lambda: la.optimize_prior_precision(method="marglik", n_steps=2)
            ),
        ),
        **_raises(RuntimeError, "element 0 of tensors does not require grad"),
    ),
    "upstream-lowrank": Case(
        _upstream_fit(_net, hessian_structure="lowrank"), **_LOWRANK_ERROR, laplace_fit=True
    ),
    # -- what lsn_ext checks itself where it sees them ------------------------------------------
    "backend-all-frozen": Case(
        _plain(_frozen_net, lambda net: DiagBackprop(net, "classification")),
        **_raises(ValueError, r"all 6 parameter tensors of Sequential are frozen.*Unfreeze"),
    ),
    "backend-no-parameters": Case(
        _plain(_parameterless_net, lambda net: DiagBackprop(net, "classification")),
        **_raises(ValueError, "Sequential has no parameters at all"),
    ),
    "backend-eig-lowrank-train-mode": Case(
        _train_mode("ce", lambda la: la.backend.eig_lowrank(_loader(_x(), _y()))),
        **_raises(ValueError, r"eig_lowrank needs the model in eval mode, but 1 \(BatchNorm2d\)"),
    ),
    "backend-eig-lowrank-bad-rank": Case(
        _with_fitted("ce", lambda la: la.backend.eig_lowrank(_loader(_x(), _y()), rank=0)),
        **_raises(ValueError, "rank must be an int ≥ 1, got 0"),
    ),
    "check-before-fit-all-frozen": Case(
        _plain(_frozen_net, lambda net: check_before_laplace_fit(net, _loader(_x(), _y()))),
        **_raises(ValueError, "are frozen"),
    ),
    "check-before-fit-channels-last": Case(
        _plain(_channels_last_net, lambda net: check_before_laplace_fit(net, _loader(_x(), _y()))),
        **_raises(ValueError, r"parameter 0\.weight \(3, 2, 3, 3\) is not contiguous.*contiguous_"),
    ),
    "check-before-fit-loader-without-batches": Case(
        _plain(_net, lambda net: check_before_laplace_fit(net, _no_batches())),
        **_raises(ValueError, r"yields no batches \(its dataset has 1 samples, batch_size=2, drop"),
    ),
    "check-before-fit-valid": Case(
        _plain(_net, lambda net: check_before_laplace_fit(net, _loader(_x(), _y())) or "ok"),
        check=lambda r: r == "ok" or pytest.fail(repr(r)),
    ),
    "backend-empty-batch": Case(
        _with_fitted("ce", lambda la: la.backend.diag(_x()[:0], _y()[:0], N=4)),
        **_raises(ValueError, "non-empty batch"),
    ),
    "backend-gradients-dict": Case(
        _with_fitted("ce", lambda la: la.backend.gradients({"input_ids": _x()}, _y())),
        **_raises(ValueError, "dictionary batch.*SelectInput"),
    ),
    "laplace-call-bce": Case(
        _with_fitted("bce", lambda la: la(_x())), **_raises(ValueError, "1 for every input")
    ),
    "laplace-call-spatial-ce": Case(
        _with_fitted("ce", lambda la: la(_x())), **_raises(ValueError, r"assumes \[N, K\]")
    ),
    "optimize-prior-gridsearch-bce": Case(
        _with_fitted(
            "bce",
            lambda la: la.optimize_prior_precision(
                method="gridsearch", val_loader=_loader(_x(), _y("bce")), grid_size=2
            ),
        ),
        **_raises(ValueError, "1 for every input.*gridsearch_prior_precision"),
    ),
    "optimize-prior-marglik": Case(
        _with_fitted(
            "ce", lambda la: la.optimize_prior_precision(method="marglik", n_steps=5) or la
        ),
        check=lambda la: math.isfinite(float(la.prior_precision)) or pytest.fail("not finite"),
    ),
    # -- predict --------------------------------------------------------------------------------
    "predict-unfitted": Case(
        _unfitted(lambda la: predict(la, _x())), **_raises(ValueError, "not fitted")
    ),
    "predict-not-a-posterior": Case(
        _plain(_net, lambda net: predict(net, _x())),
        **_raises(TypeError, "laplace-torch Laplace object or a posterior"),
    ),
    "predict-nan-inputs": Case(
        _with_fitted("ce", lambda la: predict(la, _nan_at(_x()), 3)),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "predict-list-inputs": Case(
        _with_fitted("ce", lambda la: predict(la, _x().tolist(), 3)),
        **_raises(TypeError, "x must be a tensor"),
    ),
    "predict-empty-batch": Case(
        _with_fitted("ce", lambda la: predict(la, _x()[:0], 3)),
        **_raises(ValueError, "non-empty batch"),
    ),
    "predict-one-sample": Case(
        _with_fitted("ce", lambda la: predict(la, _x(), 1)), **_raises(ValueError, "at least 2")
    ),
    "predict-float-n-samples": Case(
        _with_fitted("ce", lambda la: predict(la, _x(), 2.5)),
        **_raises(ValueError, "n_samples must be an int"),
    ),
    "predict-wrong-input-channels": Case(
        _with_fitted("ce", lambda la: predict(la, torch.randn(2, 3, 6, 6, dtype=F64), 2)),
        **_raises(RuntimeError, "channels"),
    ),
    "predict-train-mode-batch-norm": Case(
        _train_mode("ce", lambda la: predict(la, _x(), 3)),
        **_raises(ValueError, r"BatchNorm2d\) is in training mode.*model\.eval\(\)"),
    ),
    "predict-bce-loaded-without-loss": Case(
        _loaded_without_loss(lambda la: predict(la, _x(), 3)),
        **_raises(ValueError, r"one logit channel.*state_dict"),
    ),
    "predict-eval-model": Case(
        _with_fitted("ce", lambda la: predict(la, _x(), 3)), check=_check_prediction
    ),
    "predict-inference-mode": Case(
        _with_fitted("ce", lambda la: _under_inference_mode(lambda: predict(la, _x(), 3))),
        check=_check_prediction,
    ),
    # -- gridsearch_prior_precision -----------------------------------------------------------
    "gridsearch-255-without-ignore-index": Case(
        _gs(_with_255(_y())), **_raises(ValueError, r"255 is outside \[0, 2\).*ignore_index")
    ),
    "gridsearch-255-with-ignore-index": Case(
        _gs(_with_255(_y()), ignore_index=255), check=_check_grid_result
    ),
    "gridsearch-minus-100-ignored-by-default": Case(
        _gs(torch.where(_y() == 0, -100, _y())), check=_check_grid_result
    ),
    "gridsearch-all-ignored": Case(
        _gs(torch.full((4, 6, 6), -100)), **_raises(ValueError, "no labelled pixels")
    ),
    "gridsearch-nan-bce-targets": Case(
        _gs(_bce_nan(), loss="bce"), **_raises(ValueError, "NaN or infinite")
    ),
    "gridsearch-bce-target-out-of-range": Case(
        _gs(_y("bce") * 2, loss="bce"), **_raises(ValueError, r"outside \[0, 1\]")
    ),
    "gridsearch-float-ce-targets": Case(
        _gs(_y().double()), **_raises(ValueError, "integer class indices")
    ),
    "gridsearch-wrong-target-shape": Case(
        _gs(_y()[:, :3]), **_raises(ValueError, r"must have shape \(2, 6, 6\)")
    ),
    "gridsearch-nan-inputs": Case(_gs(x=_nan_at(_x())), **_raises(ValueError, "NaN or infinite")),
    "gridsearch-empty-loader": Case(
        _with_fitted("ce", lambda la: gridsearch_prior_precision(la, [], grid=[1.0])),
        **_raises(ValueError, "no batches"),
    ),
    "gridsearch-loader-without-batches": Case(
        _with_fitted("ce", lambda la: gridsearch_prior_precision(la, _no_batches(), grid=[1.0])),
        **_raises(ValueError, "no batches"),
    ),
    "gridsearch-dict-batches": Case(
        _with_fitted(
            "ce", lambda la: gridsearch_prior_precision(la, [{"x": _x(), "y": _y()}], grid=[1.0])
        ),
        **_raises(ValueError, r"no key dict_key_y='labels' \(keys: \['x', 'y'\]\)"),
    ),
    "gridsearch-dict-batches-plain-model": Case(
        _with_fitted(
            "ce",
            lambda la: gridsearch_prior_precision(
                la, [{"input_ids": _x(), "labels": _y()}], grid=[1.0]
            ),
        ),
        **_raises(ValueError, r"gridsearch_prior_precision got a dictionary batch.*SelectInput"),
    ),
    "gridsearch-negative-grid": Case(
        _gs(grid=[1.0, -1.0]), **_raises(ValueError, "finite positive")
    ),
    "gridsearch-nan-grid": Case(_gs(grid=[NAN]), **_raises(ValueError, "finite positive")),
    "gridsearch-empty-grid": Case(_gs(grid=[]), **_raises(ValueError, "finite positive")),
    "gridsearch-zero-grid-size": Case(
        _gs(grid=None, grid_size=0), **_raises(ValueError, "grid_size must be a positive int")
    ),
    "gridsearch-min-above-max": Case(
        _gs(grid=None, log_prior_prec_min=2, log_prior_prec_max=-2),
        **_raises(ValueError, "log_prior_prec_min <= log_prior_prec_max"),
    ),
    "gridsearch-base-one": Case(
        _gs(grid=None, log_prior_prec_base=1.0), **_raises(ValueError, "log_prior_prec_base")
    ),
    "gridsearch-bad-structure": Case(
        _gs(prior_structure="kron"), **_raises(ValueError, "prior_structure must be one of")
    ),
    "gridsearch-one-sample": Case(_gs(n_samples=1), **_raises(ValueError, "at least 2")),
    "gridsearch-unfitted": Case(
        _unfitted(lambda la: gridsearch_prior_precision(la, [(_x(), _y())])),
        **_raises(ValueError, "not fitted"),
    ),
    "gridsearch-regression": Case(
        _with_fitted(
            "mse", lambda la: gridsearch_prior_precision(la, [(_x(), _y("mse"))], grid=[1.0])
        ),
        **_raises(ValueError, "needs a classification likelihood.*marglik"),
    ),
    "gridsearch-vi-posterior": Case(
        _vi_call(lambda vi: gridsearch_prior_precision(vi, [(_x(), _y())])),
        **_raises(TypeError, "laplace-torch Laplace"),
    ),
    "gridsearch-error-restores-prior": Case(
        _gs_prior_restored(_y() + 7), **_raises(ValueError, r"outside \[0, 2\)")
    ),
    "gridsearch-bce-loaded-without-loss": Case(
        _loaded_without_loss(
            lambda la: gridsearch_prior_precision(la, [(_x(), _y("bce"))], grid=[1.0])
        ),
        **_raises(ValueError, "one logit channel"),
    ),
    # -- bridge_predictive (only called) --------------------------------------------------------
    "bridge-unfitted": Case(
        _unfitted(lambda la: bridge_predictive(la, _x())), **_raises(ValueError, "not fitted")
    ),
    "bridge-regression": Case(
        _with_fitted("mse", lambda la: bridge_predictive(la, _x())),
        **_raises(ValueError, "classification likelihood"),
    ),
    "bridge-unknown-variance": Case(
        _with_fitted("ce", lambda la: bridge_predictive(la, _x(), variance="exact")),
        **_raises(ValueError, "variance must be 'linearized' or 'mc'"),
    ),
    "bridge-bce": Case(
        _with_fitted("bce", lambda la: bridge_predictive(la, _x())),
        check=lambda d: torch.testing.assert_close(
            d.probs.sum(1), torch.ones(4, 6, 6, dtype=d.probs.dtype)
        ),
    ),
    # -- VariationalPosterior ---------------------------------------------------------------------
    "vi-nan-prior-precision": Case(
        _vi(prior_precision=NAN), **_raises(ValueError, "prior_precision must be finite")
    ),
    "vi-inf-prior-precision": Case(
        _vi(prior_precision=INF), **_raises(ValueError, "prior_precision must be finite")
    ),
    "vi-zero-prior-precision": Case(
        _vi(prior_precision=0.0), **_raises(ValueError, "prior_precision must be finite")
    ),
    "vi-string-prior-precision": Case(
        _vi(prior_precision="1"), **_raises(TypeError, "prior_precision must be a positive")
    ),
    "vi-nan-init-std": Case(_vi(init_std=NAN), **_raises(ValueError, "init_std must be finite")),
    "vi-negative-init-std": Case(
        _vi(init_std=-0.1), **_raises(ValueError, "init_std must be finite")
    ),
    "vi-mixture-nan-init-std": Case(
        _vi(init_std=NAN, n_components=2), **_raises(ValueError, "init_std must be finite")
    ),
    "vi-negative-rank": Case(_vi(rank=-1), **_raises(ValueError, "rank must be")),
    "vi-zero-components": Case(_vi(n_components=0), **_raises(ValueError, "n_components must be")),
    "vi-mean-reduction": Case(
        _plain(_net, lambda net: VariationalPosterior(net, nn.CrossEntropyLoss())),
        **_raises(ValueError, "reduction='sum'"),
    ),
    "vi-no-trainable-parameters": Case(
        _frozen_vi, **_raises(ValueError, "no parameters with requires_grad")
    ),
    "vi-fit-empty-list": Case(_vi_call(_vi_fit(batches=[])), **_raises(ValueError, "no data")),
    "vi-fit-empty-loader-with-n-data": Case(
        _vi_call(_vi_fit(batches=[], n_data=4)), **_raises(ValueError, "no batches")
    ),
    "vi-fit-negative-epochs": Case(
        _vi_call(_vi_fit(epochs=-1)), **_raises(ValueError, "epochs must be a positive int")
    ),
    "vi-fit-float-epochs": Case(
        _vi_call(_vi_fit(epochs=1.5)), **_raises(ValueError, "epochs must be a positive int")
    ),
    "vi-fit-nan-lr": Case(_vi_call(_vi_fit(lr=NAN)), **_raises(ValueError, "lr must be finite")),
    "vi-fit-zero-n-samples": Case(
        _vi_call(_vi_fit(n_samples=0)), **_raises(ValueError, "n_samples must be a positive")
    ),
    "vi-fit-zero-n-data": Case(
        _vi_call(_vi_fit(n_data=0)), **_raises(ValueError, "n_data must be a positive int")
    ),
    "vi-fit-nan-inputs": Case(
        _vi_call(_vi_fit(batches=[(_nan_at(_x(2)), _y("ce", 2))])),
        **_raises(ValueError, "x of shape .* NaN or infinite"),
    ),
    "vi-fit-inf-targets": Case(
        _vi_call(_vi_fit(batches=[(_x(2), _nan_at(_y("ce", 2).double(), INF))])),
        **_raises(ValueError, "y of shape .* NaN or infinite"),
    ),
    "vi-fit-inference-mode": Case(
        _vi_call(lambda vi: _under_inference_mode(lambda: _vi_fit()(vi))),
        **_raises(RuntimeError, r"fit was called under torch\.inference_mode\(\)"),
    ),
    "vi-fit-loader-without-batches": Case(
        _vi_call(_vi_fit(batches=_no_batches())), **_raises(ValueError, "no data")
    ),
    "vi-fit-empty-batch": Case(
        _vi_call(_vi_fit(batches=[(_x(0), _y("ce", 0))], n_data=4)),
        **_raises(ValueError, "non-empty batch"),
    ),
    "vi-fit-train-mode-batch-norm": Case(
        _vi_call(_vi_fit(epochs=2), train=True), check=_check_vi_fitted
    ),
    "vi-elbo-train-mode-batch-norm": Case(
        _vi_call(lambda vi: vi.elbo(_x(2), _y("ce", 2)), train=True),
        check=lambda v: math.isfinite(float(v.detach())) or pytest.fail("not finite"),
    ),
    "vi-sample-odd-paired": Case(
        _vi_call(lambda vi: vi.sample(3, mode="paired")),
        **_raises(ValueError, "positive multiple of 2"),
    ),
    "vi-sample-zero": Case(
        _vi_call(lambda vi: vi.sample(0)), **_raises(ValueError, "positive multiple of 1")
    ),
    "vi-sample-float": Case(
        _vi_call(lambda vi: vi.sample(2.0)), **_raises(ValueError, "positive multiple")
    ),
    "vi-sample-unknown-mode": Case(
        _vi_call(lambda vi: vi.sample(2, mode="sobol")), **_raises(ValueError, "mode must be")
    ),
    "vi-predict-train-mode-batch-norm": Case(
        _vi_call(lambda vi: predict(vi, _x(), 3), train=True),
        **_raises(ValueError, "training mode"),
    ),
    "vi-predict-nan-inputs": Case(
        _vi_call(lambda vi: predict(vi, _nan_at(_x()), 3)),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "vi-predict": Case(_vi_call(lambda vi: predict(vi, _x(), 3)), check=_check_prediction),
    # -- LSN helpers ----------------------------------------------------------------------------
    "fit-lsn-not-an-ssn": Case(
        _plain(_net, lambda net: fit_lsn(net, _loader(_x(), _y()))),
        **_raises(TypeError, "lsn_ext.models.SSN"),
    ),
    "fit-lsn-empty-dataset": Case(
        _fit_lsn_call(lambda: _loader(*_ssn_data(0))), **_raises(ValueError, "empty")
    ),
    "fit-lsn-loader-without-batches": Case(
        _fit_lsn_call(
            lambda: DataLoader(TensorDataset(*_ssn_data(1)), batch_size=2, drop_last=True)
        ),
        **_raises(ValueError, r"yields no batches \(its dataset has 1 samples"),
    ),
    "fit-lsn-all-frozen": Case(
        _frozen_ssn_fit(),
        **_raises(ValueError, "are frozen"),
    ),
    "fit-lsn-channels-last": Case(
        _channels_last_ssn_fit(),
        **_raises(ValueError, r"parameter backbone\..* is not contiguous.*contiguous_format"),
    ),
    "fit-lsn-list-of-batches": Case(
        _fit_lsn_call(lambda: [_ssn_data()]), **_raises(TypeError, "must be a DataLoader")
    ),
    "fit-lsn-nan-inputs": Case(
        _fit_lsn_call(lambda: _loader(_nan_at(_ssn_data()[0]), _ssn_data()[1])),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "fit-lsn-unknown-estimator": Case(
        _fit_lsn_call(lambda: _loader(*_ssn_data()), estimator="exact"),
        **_raises(ValueError, "unknown estimator"),
    ),
    "predict-lsn-not-a-laplace": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la.model, ssn, x)),
        **_raises(TypeError, "Laplace object of fit_lsn"),
    ),
    "predict-lsn-not-an-ssn": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, la.model, x)),
        **_raises(TypeError, "lsn_ext.models.SSN"),
    ),
    "predict-lsn-other-ssn": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, _ssn(), x)), **_raises(ValueError, "MeanNetwork")
    ),
    "predict-lsn-nan-inputs": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, ssn, _nan_at(x), 2, 2)),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "predict-lsn-one-epistemic-sample": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, ssn, x, 1, 2)),
        **_raises(ValueError, "n_epistemic must be an int of at least 2.*got 1"),
    ),
    "predict-lsn-one-aleatoric-sample": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, ssn, x, 2, 1)),
        **_raises(ValueError, "n_aleatoric must be an int of at least 2.*got 1"),
    ),
    "predict-lsn-aleatoric-samples-beyond-memory": Case(
        _lsn(lambda ssn, la, x: predict_lsn(la, ssn, x, 2, HUGE)),
        **_raises(ValueError, rf"n_aleatoric={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "aleatoric-samples-beyond-memory": Case(
        _ssn_call(lambda ssn, x: aleatoric_maps(ssn, x, HUGE)),
        **_raises(ValueError, rf"n_samples={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "ssn-loss-samples-beyond-memory": Case(
        _ssn_call(lambda ssn, x: ssn_loss(ssn.distribution(x), _ssn_data()[1], HUGE)),
        **_raises(ValueError, rf"n_samples={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "mc-ggn-diagonal-samples-beyond-memory": Case(
        _plain(_net, lambda net: mc_ggn_diagonal(net, _x(), _y(), "ce", mc_samples=HUGE)),
        **_raises(ValueError, rf"mc_samples={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "vi-elbo-samples-beyond-memory": Case(
        _vi_call(lambda vi: vi.elbo(_x(2), _y("ce", 2), n_samples=HUGE)),
        **_raises(ValueError, rf"n_samples/n={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "vi-sample-beyond-memory": Case(
        _vi_call(lambda vi: vi.sample(HUGE)),
        **_raises(ValueError, rf"n_samples/n={HUGE} needs .* GiB .*more than .*fewer"),
    ),
    "predict-lsn-train-mode-ssn": Case(  # evaluated in eval mode, the mode restored
        _lsn(lambda ssn, la, x: predict_lsn(la, ssn, x, 2, 2), train=True),
        check=lambda maps: _check_binary_prediction(maps.epistemic),
    ),
    "mc-dropout-without-dropout": Case(
        _plain(_net, lambda net: mc_dropout_predict(net, _x(), 3)),
        **_raises(ValueError, "no dropout module"),
    ),
    "mc-dropout-nan-inputs": Case(
        _plain(lambda: _net(dropout=0.2), lambda net: mc_dropout_predict(net, _nan_at(_x()), 3)),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "mc-dropout-one-sample": Case(
        _plain(lambda: _net(dropout=0.2), lambda net: mc_dropout_predict(net, _x(), 1)),
        **_raises(ValueError, "at least 2"),
    ),
    "mc-dropout-train-mode-model": Case(
        _plain(lambda: _net(dropout=0.2).train(), lambda net: mc_dropout_predict(net, _x(), 3)),
        check=_check_prediction,
    ),
    "ensemble-one-member": Case(
        _plain(_net, lambda net: ensemble_predict([net], _x())),
        **_raises(ValueError, r"at least 2 members.*got 1 member\b.*no spread.*lsn_ext.predict"),
    ),
    "ensemble-no-members": Case(
        _plain(_net, lambda net: ensemble_predict(iter([]), _x())),
        **_raises(ValueError, "at least 2 members to measure the spread between them; got 0"),
    ),
    "ensemble-non-module-member": Case(
        _plain(_net, lambda net: ensemble_predict([net, "net"], _x())),
        **_raises(TypeError, "member 1 is a str"),
    ),
    "ensemble-nan-inputs": Case(
        _plain(_net, lambda net: ensemble_predict([net, net], _nan_at(_x()))),
        **_raises(ValueError, "NaN or infinite"),
    ),
    "ensemble-train-mode-members": Case(
        _plain(lambda: _net().train(), lambda net: ensemble_predict([net, net], _x())),
        check=_check_prediction,
    ),
    "aleatoric-one-sample": Case(
        _ssn_call(lambda ssn, x: aleatoric_maps(ssn, x, 1)), **_raises(ValueError, "at least 2")
    ),
    "aleatoric-not-an-ssn": Case(
        _plain(_net, lambda net: aleatoric_maps(net, _x())),
        **_raises(TypeError, "lsn_ext.models.SSN"),
    ),
    "aleatoric-nan-inputs": Case(
        _ssn_call(lambda ssn, x: aleatoric_maps(ssn, _nan_at(x))),
        **_raises(ValueError, "NaN or infinite"),
    ),
}


def _allowed(diff: str, laplace_fit: bool) -> bool:
    """Differences that laplace-torch's ``fit`` makes itself (module documentation)."""
    if not laplace_fit:
        return False
    return (
        "added ['output_size']" in diff
        or diff.endswith(".grad changed")
        or "training True -> False" in diff
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input(case: Case):
    model, call = case.prepare()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = snapshot(model)
    if case.error is not None:
        exc, match = case.error
        with pytest.raises(exc, match=match):
            call()
    else:
        case.check(call())
    diffs = [d for d in differences(model, before) if not _allowed(d, case.laplace_fit)]
    assert not diffs, "the model was modified:\n  " + "\n  ".join(diffs)


def test_there_are_at_least_fifty_cases():
    assert len(CASES) >= 50


# -- what laplace-torch itself does to the model, and the README's remedies --------------------


def test_laplace_fit_leaves_the_model_in_eval_mode_without_grads_and_the_remedy_restores():
    """laplace-torch's ``fit``, not the backend: README "la.fit changes the model"."""
    net = _net(2).train()
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    was_training = {m: m.training for m in net.modules()}
    la = _laplace(net)
    la.fit(_loader(_x(), _y()))
    assert not any(m.training for m in net.modules())  # batch norm included
    assert all(p.grad is None for p in net.parameters())
    assert net.output_size == 6  # laplace-torch's n_outputs: the last axis
    for m, mode in was_training.items():  # the README's remedy
        m.train(mode)
    assert net.training
    assert net[1].training


def _classifier_laplace() -> tuple[nn.Module, Laplace]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(5))
    la = _laplace(net)
    la.fit(_loader(x, y))
    return net, la


def _aliases_mean(p: Tensor, la: Laplace) -> bool:
    return p.untyped_storage().data_ptr() == la.mean.untyped_storage().data_ptr()


def test_laplace_nn_predictive_leaves_parameters_aliasing_the_mean_and_the_remedy_detaches():
    """laplace-torch's ``la(x, pred_type="nn")`` on a plain [N, K] classifier (README)."""
    net, la = _classifier_laplace()
    before = [p.detach().clone() for p in net.parameters()]
    la(torch.randn(2, 3, dtype=F64), pred_type="nn", link_approx="mc", n_samples=3)
    assert all(_aliases_mean(p, la) for p in net.parameters())
    mean = la.mean.clone()
    with torch.no_grad():
        net[0].weight.add_(1.0)  # e.g. an optimiser step after the predictive
    assert not torch.equal(la.mean, mean)  # the posterior mean moved with the model
    with torch.no_grad():
        net[0].weight.sub_(1.0)
    torch.nn.utils.vector_to_parameters(la.mean.clone(), la.params)  # the README's remedy
    assert not any(_aliases_mean(p, la) for p in net.parameters())
    for p, b in zip(net.parameters(), before, strict=True):
        torch.testing.assert_close(p, b, rtol=0, atol=1e-15)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    torch.testing.assert_close(la.mean, mean, rtol=0, atol=1e-15)


def test_laplace_nn_predictive_normalises_segmentation_over_the_width_and_predict_does_not():
    """Upstream and silent (README "Do not call la(x)"): lsn_ext.predict is the per-pixel one."""
    _, la = _fitted("ce")
    x = _x()
    upstream = la(x, pred_type="nn", link_approx="mc", n_samples=3)
    ones = torch.ones(4, 2, 6, dtype=F64)
    torch.testing.assert_close(upstream.sum(-1), ones)  # over the image width
    assert not torch.allclose(upstream.sum(1), torch.ones(4, 6, 6, dtype=F64))
    maps = predict(la, x, 3, pred_type="nn")
    torch.testing.assert_close(maps.mean.sum(1), torch.ones(4, 6, 6, dtype=F64))


def test_channels_last_remedy_fits_contiguous_and_predicts_on_either_format():
    """README: fit with contiguous parameters, convert back; same curvature and maps."""
    net = _net(2)
    la = _laplace(net)
    la.fit(_loader(_x(), _y()))
    contiguous = predict(la, _x(), 4, generator=torch.Generator().manual_seed(0))
    db = ggn_diagonal(net, _x(), _y(), "ce", estimator="db").vector
    mc = ggn_diagonal(net, _x(), _y(), "ce", generator=torch.Generator().manual_seed(0)).vector
    net.to(memory_format=torch.channels_last)
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    last = predict(la, _x(), 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(last.mean, contiguous.mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(last.variance, contiguous.variance, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(
        ggn_diagonal(net, _x(), _y(), "ce", estimator="db").vector, db, rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        ggn_diagonal(net, _x(), _y(), "ce", generator=torch.Generator().manual_seed(0)).vector,
        mc,
        rtol=1e-12,
        atol=0,
    )
