import pytest
import torch
from torch import nn
from torch.func import jacrev

from lsn_ext.rules import DropoutRule, get_rule
from lsn_ext.rules.elementwise import scale_rule
from tests.reference import assert_rule_matches, squared_input_rule

MODULES = {
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,
    "leaky-relu-0.2": lambda: nn.LeakyReLU(0.2),
    "elu-0.7": lambda: nn.ELU(0.7),
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU("tanh"),
    "softplus-beta2-threshold1": lambda: nn.Softplus(beta=2.0, threshold=1.0),
    "identity": nn.Identity,
    "flatten": nn.Flatten,
    "unflatten": lambda: nn.Unflatten(2, (2, 2)),
    "dropout-eval": lambda: nn.Dropout(0.5).eval(),
    "dropout1d-eval": lambda: nn.Dropout1d(0.5).eval(),
    "upsample-nearest": lambda: nn.Upsample(scale_factor=2),
    "upsample-linear": lambda: nn.Upsample(scale_factor=2, mode="linear"),
}


@pytest.mark.parametrize("make", MODULES.values(), ids=MODULES.keys())
def test_parameter_free_rule_matches_jacrev(make):
    module = make()
    x = 3 * torch.randn(2, 3, 4)
    assert_rule_matches(get_rule(module), module, x)


@pytest.mark.parametrize(
    "name", ["relu", "identity", "flatten", "unflatten", "dropout-eval", "upsample-nearest"]
)
def test_autograd_exact_rules_have_zero_one_jacobians(name):
    module = MODULES[name]()
    assert get_rule(module).is_autograd_exact(module)
    J = jacrev(module)(3 * torch.randn(2, 3, 4))
    assert set(J.unique().tolist()) <= {0.0, 1.0}


def test_rules_with_other_jacobians_are_not_autograd_exact():
    for name in ("tanh", "leaky-relu-0.2", "gelu", "softplus-beta2-threshold1", "upsample-linear"):
        module = MODULES[name]()
        assert not get_rule(module).is_autograd_exact(module), name


@pytest.mark.parametrize("cls", [nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d])
def test_dropout_in_training_mode_is_refused(cls):
    module = cls(0.2).train()
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(p=0.2\) is in training mode"):
        DropoutRule().check(module)
    DropoutRule().check(cls(0.0).train())


SCALES = {
    "scalar": (lambda: -0.5, (2, 3)),
    "tensor-same-shape": (lambda: torch.randn(2, 3), (2, 3)),
    "tensor-broadcast-up": (lambda: torch.randn(4, 2, 3), (2, 3)),
    "input-broadcast": (lambda: torch.randn(2, 3), (1, 3)),
}


@pytest.mark.parametrize("case", SCALES.values(), ids=SCALES.keys())
def test_scale_rule_matches_jacrev(case):
    make_c, shape = case
    c = make_c()
    x = torch.randn(shape)
    y = c * x
    m = torch.rand_like(y if isinstance(y, torch.Tensor) else x)
    expected = squared_input_rule(lambda z: c * z, x, m)
    torch.testing.assert_close(scale_rule(m, c, x.shape), expected, rtol=1e-12, atol=1e-14)
