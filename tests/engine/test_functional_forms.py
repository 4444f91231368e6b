"""A rule's functional form reaches the native engine through the rule table alone.

The rule for ``nn.Softsign`` (not one of lsn_ext's) is written and registered here, the way a
user adds a layer; the engine then runs ``F.softsign`` in ``forward`` as a node of that rule,
with no change to :mod:`lsn_ext.engine`.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lsn_ext import CrossEntropy, diag_backprop, linearized_variance
from lsn_ext.rules import RULES, ElementwiseRule, Functional, TanhRule
from tests.networks import GraphNet
from tests.reference import dense_db, dense_forward


class SoftsignRule(ElementwiseRule):
    """``φ(x) = x / (1 + |x|)``: ``φ'(x) = 1 / (1 + |x|)²``."""

    functional = (Functional("softsign", nn.Softsign),)

    def derivative(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return (1 + x.abs()).pow(-2)


def _net(act, like: GraphNet | None = None) -> GraphNet:
    """Convolution, ``act`` (``F.softsign`` or ``"act"``, the module), 1×1 head (``like``'s)."""
    net = GraphNet(
        {"c": nn.Conv2d(2, 3, 3, padding=1), "act": nn.Softsign(), "head": nn.Conv2d(3, 2, 1)},
        [("h", "c", ("x",)), ("a", act, ("h",)), ("out", "head", ("a",))],
        "out",
    )
    if like is not None:
        net.load_state_dict(like.state_dict())
    return net


def test_a_registered_functional_form_runs_as_a_node_of_its_rule(monkeypatch):
    x, y = torch.randn(2, 2, 5, 5), torch.randint(0, 2, (2, 5, 5))
    functional = _net(F.softsign)
    with pytest.raises(NotImplementedError, match=r"'softsign'"):
        diag_backprop(functional, x, y, "ce")
    monkeypatch.setitem(RULES, nn.Softsign, SoftsignRule())
    got = diag_backprop(functional, x, y, "ce").diagonals
    f, loss = functional(x).detach(), CrossEntropy()
    want = dense_db(functional, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    assert float(got["layers.c.weight"].abs().sum()) > 0
    # The same as the module, which takes the same rule.
    module = diag_backprop(_net("act", like=functional), x, y, "ce").diagonals
    for k in want:
        torch.testing.assert_close(got[k], module[k], rtol=1e-12, atol=0, msg=k)


def test_a_registered_functional_form_runs_in_the_forward_pass_too(monkeypatch):
    monkeypatch.setitem(RULES, nn.Softsign, SoftsignRule())
    net = _net(F.softsign)
    x = torch.randn(2, 2, 4, 4)
    param_var = {n: torch.rand_like(p) for n, p in net.named_parameters()}
    _, got = linearized_variance(net, x, param_var)
    torch.testing.assert_close(got, dense_forward(net, x, param_var), rtol=1e-10, atol=1e-12)
    _, module = linearized_variance(_net("act", like=net), x, param_var)
    torch.testing.assert_close(got, module, rtol=1e-12, atol=0)


def test_the_error_lists_the_registered_functional_forms(monkeypatch):
    monkeypatch.setitem(RULES, nn.Softsign, SoftsignRule())
    net = _net(torch.exp)
    with pytest.raises(NotImplementedError, match=r"functional activations \[.*'softsign'"):
        diag_backprop(net, torch.randn(1, 2, 3, 3), torch.zeros(1, 3, 3).long(), "ce")


class _Mul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


class _MulRule(TanhRule):
    functional = (Functional("mul", _Mul),)


def test_a_functional_form_may_not_take_an_engine_handlers_name(monkeypatch):
    monkeypatch.setitem(RULES, _Mul, _MulRule())
    with pytest.raises(ValueError, match=r"\['mul'\].*_Mul.*engine's own handlers"):
        diag_backprop(_net(F.softsign), torch.randn(1, 2, 3, 3), torch.zeros(1, 3, 3).long(), "ce")
