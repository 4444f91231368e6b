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
    "leaky-relu-0": lambda: nn.LeakyReLU(0.0),
    "leaky-relu-negative-slope": lambda: nn.LeakyReLU(-0.3),
    "elu-0.7": lambda: nn.ELU(0.7),
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU("tanh"),
    "softplus-beta2-threshold1": lambda: nn.Softplus(beta=2.0, threshold=1.0),
    "mish": nn.Mish,
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "selu": nn.SELU,
    "celu-0.5": lambda: nn.CELU(0.5),  # 1/α exact in float32, as torch's CELU needs
    "softmax-dim1": lambda: nn.Softmax(dim=1),
    "softmax-last-dim": lambda: nn.Softmax(dim=-1),
    "softmax2d": nn.Softmax2d,
    "log-softmax-dim1": lambda: nn.LogSoftmax(dim=1),
    "log-softmax-last-dim": lambda: nn.LogSoftmax(dim=-1),
    "relu6": nn.ReLU6,
    "hardtanh": nn.Hardtanh,
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


@pytest.mark.parametrize("make", MODULES.values(), ids=MODULES.keys())
def test_a_rule_reads_no_tensor_it_says_it_does_not_read(make):
    """Adapters pass a shape-only (meta) tensor for what ``reads_input``/``reads_output`` deny."""
    module = make()
    rule = get_rule(module)
    x = 3 * torch.randn(2, 3, 4)
    x[0, 0, :2] = 0.0  # the kink of the piecewise-linear maps
    y = module(x)
    m_out = torch.rand_like(y)
    expected = rule.input_rule(module, x, y, m_out)
    x_seen = x if rule.reads_input(module) else torch.empty_like(x, device="meta")
    y_seen = y if rule.reads_output(module) else torch.empty_like(y, device="meta")
    torch.testing.assert_close(rule.input_rule(module, x_seen, y_seen, m_out), expected)


@pytest.mark.parametrize(
    ("slope", "reads_input", "reads_output"),
    [(0.01, False, True), (0.0, False, True), (-0.3, True, False)],
    ids=["slope-0.01", "slope-0", "negative-slope"],
)
def test_leaky_relu_reads_its_output_unless_the_slope_is_negative(slope, reads_input, reads_output):
    module = nn.LeakyReLU(slope, inplace=True)
    rule = get_rule(module)
    assert (rule.reads_input(module), rule.reads_output(module)) == (reads_input, reads_output)


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


@pytest.mark.parametrize("cls", [nn.Softmax, nn.LogSoftmax])
def test_softmax_without_a_dimension_is_refused(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(dim=None\) picks its dimension"):
        get_rule(cls()).check(cls())


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


# Each case: (module builder, input shape); the slopes are randomised by ``randomise_prelu``.
PRELU = {
    "prelu-1-param": (lambda: nn.PReLU(), (2, 3, 4)),
    "prelu-1-param-2d": (lambda: nn.PReLU(), (2, 3, 3, 3)),
    "prelu-C-params-1d": (lambda: nn.PReLU(3), (2, 3, 5)),
    "prelu-C-params-2d": (lambda: nn.PReLU(3), (2, 3, 3, 2)),
    "prelu-C-params-no-spatial": (lambda: nn.PReLU(4), (5, 4)),
}


def randomise_prelu(module):
    with torch.no_grad():
        module.weight.uniform_(-1, 1.5)
    return module


def prelu_input(shape):
    """Both signs, and exact zeros (where torch's derivative is the slope ``a``)."""
    x = 3 * torch.randn(shape)
    x.view(-1)[::5] = 0
    return x


@pytest.mark.parametrize("case", PRELU.values(), ids=PRELU.keys())
def test_prelu_rule_matches_jacrev(case):
    make, shape = case
    module = randomise_prelu(make())
    rule = get_rule(module)
    assert not rule.is_autograd_exact(module)
    assert_rule_matches(rule, module, prelu_input(shape))


def test_prelu_slope_diagonal_is_the_squared_negative_part():
    module = randomise_prelu(nn.PReLU(2))
    x = torch.tensor([[[-2.0, 3.0], [0.5, -1.0]], [[-1.0, 0.0], [-3.0, 4.0]]])
    m = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    diag = get_rule(module).param_rule(module, x, module(x), m)["weight"]
    expected = torch.tensor([1.0 * 4 + 5.0 * 1, 4.0 * 1 + 7.0 * 9])
    torch.testing.assert_close(diag, expected, rtol=0, atol=0)
