"""``functional_call_all``: substituted values reach every alias; the model is left untouched.

The reference is independent of ``torch.func``: a ``deepcopy`` of the model (which keeps its
aliases and tied weights) with the new values copied into its parameters and buffers in place.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from lsn_ext import predict
from lsn_ext._functional import expand_aliases, functional_call_all
from tests.model_state import assert_unchanged, snapshot
from tests.networks import SHARING_NETS, AliasNet, TiedNet, perturb_norms

NETS = list(SHARING_NETS)


def _net(name: str) -> nn.Module:
    return perturb_norms(SHARING_NETS[name]()).eval()


def _new_values(model: nn.Module, buffers: bool = False) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    if buffers:
        named.update(
            (n, b) for n, b in model.named_buffers() if b.is_floating_point() and "running" in n
        )
    return {n: t.detach() + 0.1 * torch.randn_like(t) for n, t in named.items()}


def _reference(model: nn.Module, values: dict[str, torch.Tensor]) -> nn.Module:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for n, v in values.items():
            module, _, attr = n.rpartition(".")
            getattr(ref.get_submodule(module), attr).copy_(v)
    return ref


@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize("buffers", [False, True], ids=["params", "params+buffers"])
def test_matches_a_copy_with_the_values_loaded(net, buffers):
    model = _net(net)
    x = torch.randn(2, 1, 16, 16)
    values = _new_values(model, buffers)
    snap = snapshot(model)
    out = functional_call_all(model, values, (x,))
    assert_unchanged(model, snap)
    torch.testing.assert_close(out, _reference(model, values)(x), rtol=0, atol=0)
    assert not torch.equal(out, model(x))  # the values were substituted


class _FixedDraws:
    """A posterior for :func:`lsn_ext.predict` whose "samples" are given vectors."""

    link = "softmax"

    def __init__(self, model: nn.Module, thetas: torch.Tensor):
        self.model, self.thetas, self.n_params = model, thetas, thetas.shape[1]

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.thetas[:n]


@pytest.mark.parametrize("net", NETS)
def test_predict_equals_copies_with_the_drawn_parameters_loaded(net):
    model = _net(net)
    x = torch.randn(2, 1, 16, 16)
    mean = nn.utils.parameters_to_vector(model.parameters()).detach()
    thetas = mean + 0.05 * torch.randn(3, mean.numel())
    snap = snapshot(model)
    pred = predict(_FixedDraws(model, thetas), x, 3)
    assert_unchanged(model, snap)
    probs = []
    for theta in thetas:
        ref = copy.deepcopy(model)
        nn.utils.vector_to_parameters(theta, ref.parameters())  # tied weights: loaded once
        probs.append(torch.softmax(ref(x), 1))
    probs = torch.stack(probs)
    torch.testing.assert_close(pred.mean, probs.mean(0))
    torch.testing.assert_close(pred.variance, probs.var(0))


def test_alias_path_substitutes_the_same_slot():
    model = AliasNet().eval()
    x = torch.randn(1, 1, 16, 16)
    values = _new_values(model)
    by_alias = {n.replace("stem.", "stem_alias."): v for n, v in values.items()}
    snap = snapshot(model)
    torch.testing.assert_close(
        functional_call_all(model, by_alias, (x,)), _reference(model, values)(x), rtol=0, atol=0
    )
    assert_unchanged(model, snap)
    assert sorted(expand_aliases(model, values)) == sorted(values)  # one path per slot


def test_tied_weight_reaches_both_modules():
    model = TiedNet().eval()
    values = _new_values(model)
    assert "mid2.weight" not in values  # named_parameters() lists the tied weight once
    expanded = expand_aliases(model, values)
    assert expanded["mid2.weight"] is expanded["mid.weight"] is values["mid.weight"]


@pytest.mark.parametrize("net", ["alias", "tied"])
def test_gradient_sums_over_every_use_of_a_shared_parameter(net):
    model = _net(net)
    x = torch.randn(2, 1, 16, 16)
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads = grad(lambda p: functional_call_all(model, p, (x,)).square().sum())(params)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_vmap_over_parameter_draws():
    model = _net("alias")
    x = torch.randn(1, 1, 16, 16)
    draws = [_new_values(model) for _ in range(3)]
    stacked = {n: torch.stack([d[n] for d in draws]) for n in draws[0]}
    out = vmap(lambda p: functional_call_all(model, p, (x,)))(stacked)
    for s, d in enumerate(draws):
        torch.testing.assert_close(out[s], _reference(model, d)(x))


def test_model_is_restored_when_forward_raises():
    model = _net("alias")
    snap = snapshot(model)
    with pytest.raises(RuntimeError):
        functional_call_all(model, _new_values(model), (torch.randn(1, 3, 16, 16),))
    assert_unchanged(model, snap)


def test_refuses_unknown_names_and_conflicting_values():
    model = AliasNet().eval()
    x = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match=r"'nope\.weight' is not a parameter or buffer"):
        functional_call_all(model, {"nope.weight": torch.zeros(1)}, (x,))
    w = model.stem.weight
    with pytest.raises(ValueError, match="name the same tensor"):
        functional_call_all(model, {"stem.weight": w + 1, "stem_alias.weight": w + 2}, (x,))


def test_torch_default_corrupts_an_aliased_model():
    """Why the helper exists (PyTorch issue 164759); fails once torch fixes the bug upstream."""
    model = AliasNet().eval()
    w = model.stem.weight
    values = {n: t.detach() + 1 for n, t in model.named_parameters()}
    functional_call(model, values, (torch.randn(1, 1, 16, 16),), strict=False)
    if model.stem.weight is w:
        pytest.xfail("torch.func.functional_call no longer corrupts aliased modules")
    assert not isinstance(model.stem.weight, nn.Parameter)
