"""Which modules the Monte-Carlo estimator's direct per-sample kernels serve.

The kernel comes from the module's rule (``Rule.per_sample_kernel``) and serves a ``torch.nn``
class itself only: a subclass registered with the same rule may compute something else
(through ``forward`` or a method it calls), which a kernel that never runs the module could not
see. Such subclasses are replayed, and their estimate is the dense per-sample reference's.
"""

import gc

import pytest
import torch
from torch import Tensor, nn

import lsn_ext
import lsn_ext.stochman_ext  # (registers StochMan's nnj classes: subclasses too)
from lsn_ext.estimators.monte_carlo import monte_carlo
from lsn_ext.estimators.per_sample import direct_kernel, direct_sample_grads
from lsn_ext.rules import RULES, ConvRule, LinearRule
from lsn_ext.rules.losses import BCEWithLogits
from tests.estimators.test_estimators import _dense_mc
from tests.rules.test_facts import KERNELS


def _bare(cls: type[nn.Module]) -> nn.Module:
    """An instance of ``cls`` without ``__init__`` (its class is all the choice reads)."""
    return cls.__new__(cls)


def test_the_kernels_serve_exactly_the_torch_classes_whose_rules_name_one():
    assert len(RULES) > 60  # torch's classes and StochMan's
    got = {cls: direct_kernel(_bare(cls)) for cls in RULES}
    assert {cls: k for cls, k in got.items() if k is not None} == KERNELS


@pytest.mark.parametrize("base", list(KERNELS), ids=lambda c: c.__name__)
def test_a_subclass_with_the_torch_forward_and_the_same_rule_is_replayed(base, monkeypatch):
    sub = type(f"My{base.__name__}", (base,), {})
    monkeypatch.setitem(RULES, sub, RULES[base])
    assert sub.forward is base.forward
    assert direct_kernel(_bare(base)) == KERNELS[base]
    assert direct_kernel(_bare(sub)) is None


def test_a_torch_class_of_another_family_gets_no_kernel(monkeypatch):
    monkeypatch.setitem(RULES, nn.Bilinear, LinearRule())  # a wrong registration
    assert direct_kernel(nn.Bilinear(2, 2, 3)) is None


class _StandardisedConv2d(nn.Conv2d):
    """Weight standardisation in ``forward``: ``conv(x, (W − mean W) / std W)`` per channel."""

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, _standardise(self.weight), self.bias)


class _StandardisedConvForward(nn.Conv2d):
    """The same, with torch's ``forward``: only the method it calls is overridden."""

    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return super()._conv_forward(x, _standardise(weight), bias)


def _standardise(w: Tensor) -> Tensor:
    mean = w.mean((1, 2, 3), keepdim=True)
    return (w - mean) / w.std((1, 2, 3), keepdim=True)


@pytest.mark.parametrize("cls", [_StandardisedConv2d, _StandardisedConvForward])
def test_a_conv_subclass_with_a_rule_that_does_not_fit_is_replayed_exactly(cls, monkeypatch):
    # Registering ConvRule for these is wrong for DB (their Jacobians are not the plain
    # convolution's); the Monte-Carlo estimator must stay right, on its leaf path.
    monkeypatch.setitem(RULES, cls, ConvRule())
    conv = cls(2, 3, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), nn.Conv2d(3, 1, 1))
    x = torch.randn(3, 2, 5, 5)
    assert direct_sample_grads(conv, {"weight": "weight"}, x, torch.randn(3, 3, 5, 5)) is None
    y, loss = (torch.rand(3, 1, 5, 5) > 0.5).double(), BCEWithLogits()
    noise = torch.randn(2, 3, 1, 5, 5)
    res = monte_carlo(model, x, y, loss, 2, None, None, noise)
    want = _dense_mc(model, x, y, loss, noise)
    for k in want:
        torch.testing.assert_close(res.diagonals[k], want[k], atol=1e-12, rtol=1e-9, msg=k)
    # Served by the leaf's replay. (A direct kernel would give the plain convolution's
    # gradients; in this verified call the per-draw check that they sum to the batch gradient
    # would reroute the weight through the whole model, "model", but that check sees sums only.)
    assert res.mc_paths == dict.fromkeys(want, "module")


class _AddOne(nn.Module):
    """``x + 1``: autograd saves neither its input nor its output."""

    def forward(self, x: Tensor) -> Tensor:
        return x + 1


class _CountHolders(nn.Module):
    """Counts, at the end of the forward pass, the live tensors on a recorded storage.

    Plain tensors only: subclasses such as the fake tensors an earlier ``torch.compile`` leaves
    behind have no data pointer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ptr, self.shape, self.holders = 0, torch.Size(), -1

    def record(self, module: nn.Module, args: tuple, out: Tensor) -> None:
        self.ptr, self.shape = out.data_ptr(), out.shape

    def forward(self, x: Tensor) -> Tensor:
        gc.collect()
        self.holders = sum(
            type(t) is Tensor and t.data_ptr() == self.ptr and t.shape == self.shape
            for t in gc.get_objects()
        )
        return x


@pytest.mark.slow  # gc.get_objects() over the whole suite's heap, twice per call
@pytest.mark.parametrize("estimator", ["mc", "db"])
def test_the_capture_keeps_no_output_of_a_module_a_kernel_serves(estimator):
    # A conv whose output autograd does not save (an addition follows): the estimator must not
    # hold it until the backward pass (a reference to every such output cost 1.34× a training
    # step's peak memory on MONAI's 3-D BasicUNet, against 1.07× without). Not the first conv:
    # the fast path keeps the outputs of the modules that take the input, where it ends the
    # backward pass.
    torch.manual_seed(0)
    count = _CountHolders()
    middle = nn.Conv2d(4, 5, 3, padding=1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), _AddOne(), middle, _AddOne(), nn.Conv2d(5, 3, 1), count
    )
    middle.register_forward_hook(count.record)
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 3, (2, 6, 6))
    lsn_ext.ggn_diagonal(model, x, y, "ce", estimator=estimator)  # first call: verified path
    lsn_ext.ggn_diagonal(model, x, y, "ce", estimator=estimator)  # the fast path
    assert count.holders == 0
    model(x)  # without the estimator: the same count (the check sees what it should)
    assert count.holders == 0
