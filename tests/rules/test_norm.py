import pytest
import torch
from torch import nn

from lsn_ext.rules import BatchNormRule, get_rule
from tests.reference import assert_rule_matches, squared_input_rule

CASES = {
    "bn1d-2d-input": (lambda: nn.BatchNorm1d(3), (4, 3)),
    "bn1d-3d-input": (lambda: nn.BatchNorm1d(3), (2, 3, 5)),
    "bn2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
    "bn3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
    "bn2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (2, 3, 4, 4)),
}


def randomise(bn):
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.3, 3)
    if bn.affine:
        bn.weight.data.uniform_(-2, 2)
        bn.bias.data.uniform_(-1, 1)
    return bn.eval()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_batchnorm_eval_matches_jacrev(case):
    make, shape = case
    assert_rule_matches(BatchNormRule(), randomise(make()), torch.randn(shape))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm2d(3).train(),
        lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(),
    ],
    ids=["training-mode", "no-running-stats"],
)
def test_batch_statistics_are_refused(make):
    module = make()
    with pytest.raises(ValueError, match=r"BatchNorm2d\(3\) normalises with batch statistics"):
        BatchNormRule().input_rule(module, torch.randn(2, 3, 2, 2), None, torch.ones(2, 3, 2, 2))


# -- instance, group and layer norm: statistics of the input ------------------------------------

# Each case: (module builder, input shape), used in evaluation mode. Instance norm uses the
# statistics of the input by default; ``unbatched`` is torch's no-batch input [C, *].
INPUT_STATS = {
    "in1d": (lambda: nn.InstanceNorm1d(3), (2, 3, 5)),
    "in1d-affine": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 5)),
    "in1d-affine-unbatched": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 6)),
    "in2d-affine": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 3)),
    "in2d-affine-no-bias": (lambda: nn.InstanceNorm2d(3, affine=True, bias=False), (2, 3, 3, 3)),
    "in3d": (lambda: nn.InstanceNorm3d(2), (2, 2, 3, 2, 2)),
    "in3d-affine": (lambda: nn.InstanceNorm3d(2, affine=True), (2, 2, 2, 3, 2)),
    "gn-1-group": (lambda: nn.GroupNorm(1, 4), (2, 4, 3, 3)),
    "gn-2-groups": (lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)),
    "gn-C-groups": (lambda: nn.GroupNorm(4, 4), (2, 4, 3, 2)),
    "gn-2-groups-no-affine": (lambda: nn.GroupNorm(2, 6, affine=False), (2, 6, 4)),
    "gn-3-groups-3d": (lambda: nn.GroupNorm(3, 6), (2, 6, 2, 2, 2)),
    "gn-2-groups-no-spatial": (lambda: nn.GroupNorm(2, 8), (3, 8)),
    "ln-last-dim": (lambda: nn.LayerNorm(5), (2, 3, 5)),
    "ln-last-2-dims": (lambda: nn.LayerNorm([3, 4]), (2, 3, 4)),
    "ln-chw": (lambda: nn.LayerNorm([2, 3, 3]), (2, 2, 3, 3)),
    "ln-no-affine": (lambda: nn.LayerNorm([3, 4], elementwise_affine=False), (2, 3, 4)),
    "ln-no-bias": (lambda: nn.LayerNorm(6, bias=False), (4, 6)),
}

# Instance norm with running statistics in evaluation mode: elementwise, like batch norm.
RUNNING_STATS = {
    "in1d-running": (lambda: nn.InstanceNorm1d(3, track_running_stats=True), (2, 3, 5)),
    "in2d-running-affine": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        (2, 3, 4, 3),
    ),
    "in2d-running-affine-unbatched": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        (3, 4, 3),
    ),
    "in3d-running-affine": (
        lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True),
        (2, 2, 2, 3, 2),
    ),
}

NORMS = {**INPUT_STATS, **RUNNING_STATS}


def randomise_norm(module):
    """Random affine parameters and running statistics, in evaluation mode."""
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-2, 2)
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.3, 3)
    return module.eval()


def norm_input(shape):
    """An input with non-zero means and unequal scales, so that the statistics matter."""
    return 1.5 + 2 * torch.randn(shape) * torch.rand(shape[-1])


@pytest.mark.parametrize("case", NORMS.values(), ids=NORMS.keys())
def test_norm_rule_matches_jacrev(case):
    make, shape = case
    module = randomise_norm(make())
    rule = get_rule(module)
    assert not rule.needs_output
    assert_rule_matches(rule, module, norm_input(shape))


@pytest.mark.parametrize("case", NORMS.values(), ids=NORMS.keys())
def test_norm_rule_needs_only_the_input(case):
    # Adapters may pass the output as a meta tensor (shape and dtype only, needs_output=False).
    make, shape = case
    module = randomise_norm(make())
    rule, x = get_rule(module), norm_input(shape)
    y = module(x).detach()
    m = torch.rand_like(y)
    meta = torch.empty(y.shape, dtype=y.dtype, device="meta")
    m_in, diags = rule.backward(module, x, y, m)
    m_in_meta, diags_meta = rule.backward(module, x, meta, m)
    torch.testing.assert_close(m_in_meta, m_in, rtol=0, atol=0)
    assert set(diags_meta) == set(diags) == {n for n, _ in module.named_parameters()}
    for k in diags:
        torch.testing.assert_close(diags_meta[k], diags[k], rtol=0, atol=0)


def test_instance_norm_without_running_stats_uses_input_statistics_in_both_modes():
    module = randomise_norm(nn.InstanceNorm2d(3, affine=True))
    x, m = norm_input((2, 3, 4, 4)), torch.rand(2, 3, 4, 4)
    rule = get_rule(module)
    evaluated = rule.backward(module, x, None, m)
    module.train()
    rule.check(module)  # no running statistics: nothing to update, training mode is fine
    assert_rule_matches(rule, module, x, m)
    trained = rule.backward(module, x, None, m)
    torch.testing.assert_close(trained[0], evaluated[0], rtol=0, atol=0)
    for k in ("weight", "bias"):
        torch.testing.assert_close(trained[1][k], evaluated[1][k], rtol=0, atol=0)
    # With running statistics the rule is elementwise: each entry scaled by (γ/σ)², no 1/n terms.
    running = randomise_norm(nn.InstanceNorm2d(3, affine=True, track_running_stats=True))
    scale = running.weight.detach().square() / (running.running_var + running.eps)
    m_in = get_rule(running).input_rule(running, x, None, m)
    torch.testing.assert_close(m_in, scale.reshape(1, 3, 1, 1) * m, rtol=1e-14, atol=0)


def test_group_norm_with_one_group_per_channel_is_instance_norm():
    group, instance = nn.GroupNorm(3, 3), nn.InstanceNorm2d(3, affine=True)
    with torch.no_grad():
        group.weight.uniform_(-2, 2)
        group.bias.uniform_(-1, 1)
        instance.load_state_dict(group.state_dict())
    x, m = norm_input((2, 3, 4, 5)), torch.rand(2, 3, 4, 5)
    m_g, d_g = get_rule(group).backward(group, x, None, m)
    m_i, d_i = get_rule(instance).backward(instance, x, None, m)
    torch.testing.assert_close(m_g, m_i, rtol=1e-13, atol=0)
    for k in ("weight", "bias"):
        torch.testing.assert_close(d_g[k], d_i[k], rtol=1e-13, atol=0)


def test_specification_closed_form_matches_jacrev():
    """The formula as written in SPEC.md, evaluated literally, is the squared Jacobian rule."""
    module = randomise_norm(nn.GroupNorm(2, 4))
    x, m = norm_input((2, 4, 3, 3)), torch.rand(2, 4, 3, 3)
    xg = x.reshape(2, 2, -1)
    n = xg.shape[-1]
    var, mean = torch.var_mean(xg, -1, correction=0, keepdim=True)
    x_hat = (xg - mean) / (var + module.eps).sqrt()
    w = (module.weight.detach().reshape(1, 4, 1, 1).square() * m).reshape(2, 2, -1)
    s0, s1, s2 = ((w * x_hat**k).sum(-1, keepdim=True) for k in range(3))
    m_in = (w * (1 - 2 * (1 + x_hat**2) / n) + (s0 + 2 * x_hat * s1 + x_hat**2 * s2) / n**2) / (
        var + module.eps
    )
    expected = squared_input_rule(module, x, m)
    torch.testing.assert_close(m_in.reshape(x.shape), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(get_rule(module).input_rule(module, x, None, m), expected)


@pytest.mark.parametrize(
    "make",
    [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d],
    ids=["in1d", "in2d", "in3d"],
)
def test_instance_norm_updating_running_statistics_is_refused(make):
    module = make(3, track_running_stats=True).train()
    rule = get_rule(module)
    name = make.__name__
    pattern = rf"{name}\(3\) has track_running_stats=True and is in training mode.*model\.eval\(\)"
    with pytest.raises(ValueError, match=pattern):
        rule.check(module)
    x = torch.randn((2, 3) + (3,) * int(name[-2]))
    with pytest.raises(ValueError, match=pattern):
        rule.input_rule(module, x, None, torch.ones_like(x))
    with pytest.raises(ValueError, match=pattern):
        rule.forward_rule(module, x, x, torch.ones_like(x), {})
    rule.check(module.eval())
    rule.check(make(3).train())  # no running statistics: nothing to update


@pytest.mark.parametrize(
    "case",
    [
        (lambda: nn.LayerNorm(4), (1, 4, 3, 3), (0, 2, 3, 1)),
        (lambda: nn.LayerNorm(4, bias=False), (1, 4, 3, 2, 2), (0, 2, 3, 4, 1)),
        (lambda: nn.GroupNorm(2, 4), (1, 3, 3, 4), (0, 3, 1, 2)),
    ],
    ids=["ln-channels-last-2d", "ln-channels-last-3d", "gn-permuted-to-channels-first"],
)
def test_group_stats_rules_take_a_non_contiguous_batch_of_one(case):
    """The ConvNeXt idiom ``x.permute(0, 2, 3, 1)`` then ``LayerNorm(C)``, batch 1 (3-D volumes).

    A batch of one reshapes to a view, not a copy, which torch's fused group norm refused.
    """
    make, shape, order = case
    module = randomise_norm(make())
    x = norm_input(shape).permute(order)
    assert not x.is_contiguous()
    rule = get_rule(module)
    assert_rule_matches(rule, module, x)
    torch.testing.assert_close(
        rule.standardised(module, x), rule.standardised(module, x.contiguous()), rtol=0, atol=0
    )
