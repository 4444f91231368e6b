"""Every rule's ``forward_rule`` (linearised variance) against dense jacrev references.

The case tables are those of the backward tests, so both directions cover the same layers.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext.rules import (
    AvgPoolRule,
    ConvRule,
    DropoutRule,
    LinearRule,
    Rule,
    StructuralRule,
    UpsampleRule,
    get_rule,
)
from lsn_ext.rules.elementwise import scale_forward_rule
from lsn_ext.rules.upsample import interpolate_forward_rule
from tests.reference import (
    assert_forward_rule_matches,
    squared_forward_input_rule,
    squared_forward_param_rule,
)
from tests.rules import (
    test_conv,
    test_elementwise,
    test_linear,
    test_norm,
    test_pooling,
    test_upsample,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


@pytest.mark.parametrize("case", test_linear.CASES.values(), ids=test_linear.CASES.keys())
def test_linear_forward_rule(case):
    (n_in, n_out, bias), shape = case
    assert_forward_rule_matches(LinearRule(), nn.Linear(n_in, n_out, bias=bias), torch.randn(shape))


@pytest.mark.parametrize("case", test_conv.CASES.values(), ids=test_conv.CASES.keys())
def test_conv_forward_rule(case):
    make, shape = case
    assert_forward_rule_matches(ConvRule(), make(), torch.randn(shape))


@pytest.mark.parametrize("mode", test_conv.MODES)
@pytest.mark.parametrize("case", test_conv.PADDED.values(), ids=test_conv.PADDED.keys())
def test_conv_forward_rule_padding_mode_is_pad_layer_then_conv(case, mode):
    make, shape = case
    module, x = make(mode), torch.randn(shape)
    with torch.no_grad():
        y = module(x)
    v_in = torch.rand_like(x)
    var = {k: torch.rand_like(p) for k, p in module.named_parameters()}
    pad_fn, conv_fn = test_conv._split(module, mode)
    # (a) the padding's forward step (its Jacobian is 0/1), (b) the unpadded convolution.
    v_pad = squared_forward_input_rule(pad_fn, x, v_in)
    torch.testing.assert_close(v_pad, pad_fn(v_in), rtol=0, atol=0)
    expected_in = squared_forward_input_rule(conv_fn, pad_fn(x), v_pad)
    # The parameters' contribution is exact for the whole module.
    expected_p = squared_forward_param_rule(module, x, var)
    v_out = ConvRule().forward_rule(module, x, y, v_in, var)
    torch.testing.assert_close(v_out, expected_in + expected_p, rtol=1e-10, atol=1e-12)
    assert (v_out >= 0).all()


def test_conv_forward_reflect_granularity_drops_covariance_of_copies():
    module = nn.Conv1d(1, 1, 3, padding=2, padding_mode="reflect")
    x, v_in = torch.randn(1, 1, 5), torch.rand(1, 1, 5)
    y = module(x).detach()
    v_out = ConvRule().forward_rule(module, x, y, v_in, {})
    module_level = squared_forward_input_rule(module, x, v_in)
    # Output 0 sees padded positions (x2, x1, x0): no copies twice, agrees; output 1 sees
    # (x1, x0, x1), where x1 appears twice and the split rule drops their covariance.
    torch.testing.assert_close(v_out[..., 0], module_level[..., 0])
    assert not torch.allclose(v_out[..., 1], module_level[..., 1])


def test_conv_transpose_forward_rule_with_output_size():
    module = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    assert_forward_rule_matches(ConvRule(), module, torch.randn(2, 2, 3, 3), output_size=[6, 5])


ELEMENTWISE = test_elementwise.MODULES


@pytest.mark.parametrize("make", ELEMENTWISE.values(), ids=ELEMENTWISE.keys())
def test_parameter_free_forward_rule(make):
    module = make()
    assert_forward_rule_matches(get_rule(module), module, 3 * torch.randn(2, 3, 4))


@pytest.mark.parametrize(
    "case", test_elementwise.SCALES.values(), ids=test_elementwise.SCALES.keys()
)
def test_scale_forward_rule(case):
    make_c, shape = case
    c = make_c()
    x, v = torch.randn(shape), torch.rand(shape)

    def fn(z):
        return c * z

    y = fn(x)
    expected = squared_forward_input_rule(fn, x, v)
    torch.testing.assert_close(scale_forward_rule(v, c, y.shape), expected, rtol=1e-12, atol=0)


AVG = test_pooling.AVG_CASES


@pytest.mark.parametrize("case", AVG.values(), ids=AVG.keys())
def test_avgpool_forward_rule(case):
    module, shape = case
    assert_forward_rule_matches(AvgPoolRule(), module, torch.randn(shape))


def test_avgpool_forward_is_pooling_over_k4_for_plain_kxk():
    pool = nn.AvgPool2d(2)
    x, v = torch.randn(1, 2, 4, 6), torch.rand(1, 2, 4, 6)
    v_out = AvgPoolRule().forward_rule(pool, x, pool(x), v, {})
    torch.testing.assert_close(v_out, F.avg_pool2d(v, 2, divisor_override=1) / 16)


MAX = test_pooling.MAX_CASES


@pytest.mark.parametrize("case", MAX.values(), ids=MAX.keys())
def test_maxpool_forward_rule(case):
    module, shape = case
    assert_forward_rule_matches(StructuralRule(), module, torch.randn(shape))


def test_maxpool_forward_selects_at_the_maximum_of_x_not_of_v():
    pool = nn.MaxPool1d(2, return_indices=True)
    x = torch.tensor([[[1.0, 0.0, -1.0, 2.0]]])
    v = torch.tensor([[[0.1, 5.0, 7.0, 0.3]]])
    y, _ = pool(x)
    v_out = StructuralRule().forward_rule(pool, x, y, v, {})
    torch.testing.assert_close(v_out, torch.tensor([[[0.1, 0.3]]]))


UPSAMPLE = test_upsample.MODULE_CASES


@pytest.mark.parametrize("case", UPSAMPLE.values(), ids=UPSAMPLE.keys())
def test_upsample_forward_rule(case):
    module, shape = case
    assert_forward_rule_matches(UpsampleRule(), module, torch.randn(shape))


FUNCTIONAL = test_upsample.FUNCTIONAL_CASES


@pytest.mark.parametrize("kwargs", FUNCTIONAL.values(), ids=FUNCTIONAL.keys())
def test_interpolate_forward_rule(kwargs):
    x, v = torch.randn(2, 3, 5, 7), torch.rand(2, 3, 5, 7)

    def f(t):
        return F.interpolate(t, **kwargs)

    y = f(x)
    v_out = interpolate_forward_rule(x, y, v, **kwargs)
    torch.testing.assert_close(v_out, squared_forward_input_rule(f, x, v), rtol=1e-10, atol=1e-12)
    assert interpolate_forward_rule(x, y, None, **kwargs).abs().max() == 0


def test_interpolate_forward_rule_rejects_mismatched_shapes():
    x = torch.randn(1, 2, 4)
    y = F.interpolate(x, scale_factor=2, mode="linear")
    with pytest.raises(ValueError, match="v_in has shape"):
        interpolate_forward_rule(x, y, torch.ones(1, 2, 8), scale_factor=2, mode="linear")
    with pytest.raises(ValueError, match="output has 8"):
        interpolate_forward_rule(x, y, torch.ones_like(x), scale_factor=3, mode="linear")


@pytest.mark.parametrize("case", test_norm.CASES.values(), ids=test_norm.CASES.keys())
def test_batchnorm_forward_rule(case):
    make, shape = case
    module = test_norm.randomise(make())
    assert_forward_rule_matches(get_rule(module), module, torch.randn(shape))


def test_batchnorm_forward_refuses_batch_statistics():
    module = nn.BatchNorm2d(3).train()
    x = torch.randn(2, 3, 2, 2)
    with pytest.raises(ValueError, match="batch statistics"):
        get_rule(module).forward_rule(module, x, x, torch.ones_like(x), {})


NORMS = test_norm.NORMS


@pytest.mark.parametrize("case", NORMS.values(), ids=NORMS.keys())
def test_instance_group_layer_norm_forward_rule(case):
    make, shape = case
    module = test_norm.randomise_norm(make())
    assert_forward_rule_matches(get_rule(module), module, test_norm.norm_input(shape))


def test_instance_norm_forward_refuses_updating_running_statistics():
    module = nn.InstanceNorm2d(3, track_running_stats=True).train()
    x = torch.randn(2, 3, 2, 2)
    with pytest.raises(ValueError, match=r"track_running_stats=True.*model\.eval\(\)"):
        get_rule(module).forward_rule(module, x, x, torch.ones_like(x), {})


PRELU = test_elementwise.PRELU


@pytest.mark.parametrize("case", PRELU.values(), ids=PRELU.keys())
def test_prelu_forward_rule(case):
    make, shape = case
    module = test_elementwise.randomise_prelu(make())
    assert_forward_rule_matches(get_rule(module), module, test_elementwise.prelu_input(shape))


def test_dropout_forward_refuses_training_mode():
    module = nn.Dropout(0.3)
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="training mode"):
        DropoutRule().forward_rule(module, x, x, torch.ones_like(x), {})


def test_rule_without_forward_rule_raises():
    class Half(Rule):
        def input_rule(self, module, x, y, m_out):
            return m_out / 4

    with pytest.raises(NotImplementedError, match="Half has no forward_rule for Identity"):
        Half().forward_rule(nn.Identity(), torch.ones(1), torch.ones(1), torch.ones(1), {})


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"),
        lambda: nn.ConvTranspose2d(2, 3, 2, stride=2),
        lambda: nn.Linear(4, 3),
        lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
        lambda: nn.Tanh(),
        lambda: test_norm.randomise(nn.BatchNorm2d(2)),
        lambda: test_norm.randomise_norm(nn.InstanceNorm2d(2, affine=True)),
        lambda: test_norm.randomise_norm(nn.GroupNorm(1, 2)),
        lambda: test_norm.randomise_norm(nn.LayerNorm([4, 4])),
        lambda: test_elementwise.randomise_prelu(nn.PReLU(2)),
    ],
    ids=[
        "conv-reflect",
        "convT",
        "linear",
        "bilinear",
        "tanh",
        "batchnorm",
        "instancenorm",
        "groupnorm",
        "layernorm",
        "prelu",
    ],
)
def test_forward_rule_float32_matches_float64(make):
    module = make()
    x = torch.randn(2, 2, 4, 4)
    v = torch.rand_like(x)
    var = {k: torch.rand_like(p) for k, p in module.named_parameters()}
    y = module(x).detach()
    v64 = get_rule(module).forward_rule(module, x, y, v, var)
    module32 = module.float()
    x32 = x.float()
    var32 = {k: t.float() for k, t in var.items()}
    v32 = get_rule(module32).forward_rule(module32, x32, module32(x32).detach(), v.float(), var32)
    assert v32.dtype == torch.float32
    torch.testing.assert_close(v32.double(), v64, rtol=1e-5, atol=1e-6)
