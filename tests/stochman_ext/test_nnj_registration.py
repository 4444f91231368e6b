"""StochMan's classes take the rules of their ``torch.nn`` parents; no table of rules of its own."""

import pytest
import torch
from stochman import nnj
from torch import nn

from lsn_ext import stochman_ext as sx
from lsn_ext.rules import RULES, TanhRule
from lsn_ext.stochman_ext.layers import SAME_FORWARD, torch_parent

# The classes of StochMan 0.3.0 with a forward of their own, and a module of torch.nn that
# computes the same (checked below on random inputs).
OWN_FORWARD = {
    "Identity": (nnj.Identity(), nn.Identity()),
    "Flatten": (nnj.Flatten(), nn.Flatten()),
    "Reshape": (nnj.Reshape(3, 4), nn.Unflatten(1, (3, 4))),
    "MaxPool1d": (nnj.MaxPool1d(2), nn.MaxPool1d(2)),
    "MaxPool2d": (nnj.MaxPool2d(2), nn.MaxPool2d(2)),
    "MaxPool3d": (nnj.MaxPool3d(2), nn.MaxPool3d(2)),
}
INPUTS = {
    "Identity": (2, 3, 4),
    "Flatten": (2, 3, 4, 5),
    "Reshape": (2, 12),
    "MaxPool1d": (2, 3, 8),
    "MaxPool2d": (2, 3, 8, 8),
    "MaxPool3d": (2, 3, 4, 4, 4),
}


def test_every_listed_class_has_its_torch_parents_rule():
    assert len(SAME_FORWARD) == len(set(SAME_FORWARD)) == 48
    for cls in SAME_FORWARD:
        assert RULES[cls] is RULES[torch_parent(cls)], cls
    assert torch_parent(nnj.Conv2d) is nn.Conv2d
    assert torch_parent(sx.MeanHead) is nn.Conv2d
    assert torch_parent(nnj.BatchNorm3d) is nn.BatchNorm3d
    assert torch_parent(sx.Reshape) is nn.Unflatten
    assert torch_parent(sx.Identity) is nn.Identity


def test_the_listed_nnj_classes_run_their_parents_forward():
    for cls in SAME_FORWARD:
        if cls.__name__ in OWN_FORWARD:
            continue
        assert cls.forward is torch_parent(cls).forward, cls


@pytest.mark.parametrize("name", OWN_FORWARD)
def test_the_listed_classes_with_a_forward_of_their_own_compute_their_parents(name):
    stochman, plain = OWN_FORWARD[name]
    assert type(stochman) in SAME_FORWARD
    assert type(stochman).forward is not type(plain).forward
    assert torch_parent(type(stochman)) is type(plain)
    x = torch.randn(INPUTS[name])
    torch.testing.assert_close(stochman(x), plain(x), rtol=0, atol=0)


def test_classes_with_another_forward_are_not_listed():
    for cls in (nnj.ArcTanh, nnj.PosLinear, nnj.Sqrt):
        assert cls not in SAME_FORWARD
        assert cls not in RULES


def test_registration_takes_the_rule_registered_for_the_parent(monkeypatch):
    mine = TanhRule()
    monkeypatch.setitem(RULES, nn.Tanh, mine)
    for cls in (nnj.Tanh, sx.Tanh):
        monkeypatch.delitem(RULES, cls)
    assert sx.register() == [nnj.Tanh, sx.Tanh]
    assert RULES[nnj.Tanh] is mine
    assert RULES[sx.Tanh] is mine
