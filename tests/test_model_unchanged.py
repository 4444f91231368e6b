"""No public function modifies the model.

Every public function that runs a network is called on every network of
:data:`tests.networks.SHARING_NETS` (a plain net, a module registered under two names, a weight
tied across two modules, MONAI's ``DynUNet``, nnU-Net's ``PlainConvUNet``), in eval mode, and
the model must afterwards be exactly as before (:func:`tests.model_state.assert_unchanged`):
the same parameter objects, still leaf ``nn.Parameter`` s with the same values,
``requires_grad`` and ``.grad``; the same buffers; the same modes, attributes, hooks and
``state_dict``. Every parameter is given a random ``.grad`` first, so that a function that
clears or accumulates gradients is caught.

A case prepares what the call needs (a fitted posterior, an SSN around the network) before the
snapshot and returns the module to check and the call. The Monte-Carlo estimator refuses
weights tied across modules: those cases (marked ``refuses``) must raise ``NotImplementedError``
and leave the model unchanged all the same. Posteriors are fitted with an estimator that supports
the network (:func:`_estimator`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from laplace import Laplace
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lsn_ext import (
    DiagBackprop,
    VariationalPosterior,
    bridge_predictive,
    diag_backprop,
    ggn_diagonal,
    gridsearch_prior_precision,
    linearized_variance,
    predict,
)
from lsn_ext.exact import exact_ggn_diagonal, mc_ggn_diagonal
from lsn_ext.lsn import (
    aleatoric_maps,
    ensemble_predict,
    fit_lsn,
    mc_dropout_predict,
    predict_lsn,
)
from lsn_ext.models.ssn import SSN
from tests.model_state import assert_unchanged, snapshot
from tests.networks import SHARING_NETS, AliasNet, perturb_norms

Call = Callable[[], object]
Prepare = Callable[[nn.Module, Tensor, Tensor], tuple[nn.Module, Call]]


def _estimator(model: nn.Module) -> str:
    """The Monte-Carlo estimator: it runs on every network here, tied weights included."""
    return "mc"


def _laplace(model: nn.Module, x: Tensor, y: Tensor) -> Laplace:
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={"estimator": _estimator(model), "seed": 0},
    )
    la.fit(_loader(x, y))
    return la


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _variance(model: nn.Module) -> Tensor:
    return torch.full((sum(p.numel() for p in model.parameters()),), 1e-3)


def _ssn(model: nn.Module) -> SSN:
    return SSN(model, features=2, num_classes=2, rank=2).eval()


def _loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=len(x))


def _predict(model, x, y):
    la = _laplace(model, x, y)
    return model, lambda: predict(la, x, 3, generator=_gen())


def _gridsearch(model, x, y):
    la = _laplace(model, x, y)
    return model, lambda: gridsearch_prior_precision(la, [(x, y)], grid=[0.1, 10.0], n_samples=2)


def _bridge(variance):
    def prepare(model, x, y):
        la = _laplace(model, x, y)
        return model, lambda: bridge_predictive(
            la, x, variance=variance, n_samples=3, generator=_gen()
        )

    return prepare


def _linearized(model, x, y):
    return model, lambda: linearized_variance(model, x, _variance(model))


def _vi_fit(model, x, y):
    return model, lambda: VariationalPosterior(model, "ce", rank=1).fit(
        [(x, y)], n_samples=2, generator=_gen()
    )


def _vi_predict(model, x, y):
    vp = VariationalPosterior(model, "ce", rank=1, generator=_gen())
    return model, lambda: predict(vp, x, 3, generator=_gen())


def _vi_loop(model, x, y):
    vp = VariationalPosterior(model, "ce", rank=1, generator=_gen())
    return model, lambda: vp.batched_log_likelihood(vp.sample(2, _gen()), x, y, vectorize=False)


def _ggn(estimator):
    def prepare(model, x, y):
        return model, lambda: ggn_diagonal(model, x, y, "ce", estimator=estimator, generator=_gen())

    return prepare


def _diag_backprop(model, x, y):
    return model, lambda: diag_backprop(model, x, y, "ce")


def _exact(model, x, y):
    # One VJP per logit: one 8×8 image keeps it at 128.
    return model, lambda: exact_ggn_diagonal(model, x[:1, :, :8, :8], y[:1, :8, :8], "ce")


def _mc_exact(model, x, y):
    return model, lambda: mc_ggn_diagonal(model, x, y, "ce", generator=_gen())


def _fit_lsn(model, x, y):
    ssn = _ssn(model)
    return ssn, lambda: fit_lsn(ssn, _loader(x, y), estimator=_estimator(model), seed=0)


def _predict_lsn(model, x, y):
    ssn = _ssn(model)
    la = fit_lsn(ssn, _loader(x, y), estimator=_estimator(model), seed=0)
    return ssn, lambda: predict_lsn(la, ssn, x, 2, 2)


def _aleatoric(model, x, y):
    ssn = _ssn(model)
    return ssn, lambda: aleatoric_maps(ssn, x, 2, generator=_gen())


def _mc_dropout(model, x, y):
    net = nn.Sequential(model, nn.Dropout2d(0.5)).eval()
    return net, lambda: mc_dropout_predict(net, x, 2)


def _ensemble(model, x, y):
    return model, lambda: ensemble_predict([model, copy.deepcopy(model)], x)


@dataclass(frozen=True)
class Case:
    """A public function: how to call it, and the networks it refuses."""

    prepare: Prepare
    refuses: frozenset[str] = frozenset()


CASES = {
    "predict": Case(_predict),
    "gridsearch_prior_precision": Case(_gridsearch),
    "bridge_predictive-mc": Case(_bridge("mc")),
    "bridge_predictive-linearized": Case(_bridge("linearized")),
    "linearized_variance": Case(_linearized),
    "VariationalPosterior.fit": Case(_vi_fit),
    "predict-VariationalPosterior": Case(_vi_predict),
    "VariationalPosterior.batched_log_likelihood-loop": Case(_vi_loop),
    "diag_backprop": Case(_diag_backprop),
    "ggn_diagonal-mc": Case(_ggn("mc")),
    "ggn_diagonal-db": Case(_ggn("db")),
    "ggn_diagonal-db_calibrated": Case(_ggn("db_calibrated")),
    "exact_ggn_diagonal": Case(_exact),
    "mc_ggn_diagonal": Case(_mc_exact),
    "fit_lsn": Case(_fit_lsn),
    "predict_lsn": Case(_predict_lsn),
    "aleatoric_maps": Case(_aleatoric),
    "mc_dropout_predict": Case(_mc_dropout),
    "ensemble_predict": Case(_ensemble),
}


def _params():
    for fn, case in CASES.items():
        for net in SHARING_NETS:
            refuses = net in case.refuses
            suffix = "-refuses" if refuses else ""
            yield pytest.param(case, net, refuses, id=f"{fn}-{net}{suffix}")


@pytest.fixture
def data() -> tuple[Tensor, Tensor]:
    return torch.randn(2, 1, 16, 16), torch.randint(0, 2, (2, 16, 16))


def _give_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = torch.randn_like(p)


@pytest.mark.parametrize(("case", "net", "refuses"), list(_params()))
def test_public_function_leaves_the_model_unchanged(case, net, refuses, data):
    x, y = data
    model = perturb_norms(SHARING_NETS[net]()).eval()
    checked, call = case.prepare(model, x, y)
    _give_grads(checked)
    snap = snapshot(checked)
    if refuses:
        with pytest.raises(NotImplementedError):
            call()
    else:
        call()
    assert_unchanged(checked, snap)


def test_predict_keeps_the_parameter_of_an_aliased_module():
    """The reported bug: ``predict`` left a plain tensor in place of ``model.stem.weight``."""
    model = AliasNet().eval()
    x, y = torch.randn(2, 1, 16, 16), torch.randint(0, 2, (2, 16, 16))
    la = _laplace(model, x, y)
    w = model.stem.weight
    before = model(x)
    predict(la, x, 3, generator=_gen())
    assert model.stem.weight is w
    assert isinstance(model.stem_alias.weight, nn.Parameter)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


_MODE_CASES = {
    "fit_lsn": _fit_lsn,
    "predict_lsn": _predict_lsn,
    "aleatoric_maps": _aleatoric,
    "mc_dropout_predict": _mc_dropout,
    "ensemble_predict": _ensemble,
}


@pytest.mark.parametrize("prepare", _MODE_CASES.values(), ids=_MODE_CASES.keys())
def test_mixed_modes_are_restored_module_by_module(prepare, data):
    """Functions that switch modes restore each module's own flag, not the root's everywhere."""
    x, y = data
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 1))
    checked, call = prepare(model, x, y)
    checked.eval()
    model[1].train()  # a parameter-free module in train mode: results as in eval mode
    snap = snapshot(checked)
    call()
    assert_unchanged(checked, snap)
