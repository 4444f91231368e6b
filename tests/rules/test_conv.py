import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lsn_ext import _kernels
from lsn_ext.rules import ConvRule
from lsn_ext.rules import conv as conv_rules
from tests.reference import (
    assert_rule_matches,
    block_input_rule,
    squared_input_rule,
    squared_param_rule,
)

# PyTorch's own forward warns that 'same' with an even kernel copies the input; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")

# name -> (module factory, input shape); zero padding, so the rule is exact for the whole module.
CASES = {
    "conv1d": (lambda: nn.Conv1d(2, 3, 3), (2, 2, 7)),
    "conv1d-stride2-pad1": (lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), (2, 2, 7)),
    "conv1d-dilation2-pad2": (lambda: nn.Conv1d(2, 2, 3, dilation=2, padding=2), (2, 2, 8)),
    "conv1d-groups2-nobias": (lambda: nn.Conv1d(4, 2, 3, groups=2, bias=False), (2, 4, 6)),
    "conv1d-valid": (lambda: nn.Conv1d(2, 2, 3, padding="valid"), (2, 2, 6)),
    "conv1d-same-odd-kernel": (lambda: nn.Conv1d(2, 2, 3, padding="same"), (2, 2, 6)),
    "conv1d-same-even-kernel": (lambda: nn.Conv1d(2, 2, 4, padding="same"), (2, 2, 6)),
    "conv1d-same-even-dilation3": (
        lambda: nn.Conv1d(2, 2, 2, padding="same", dilation=3),
        (2, 2, 7),
    ),
    "conv1d-unbatched": (lambda: nn.Conv1d(2, 3, 3, padding=1), (2, 7)),
    "conv1d-pad-beyond-kernel": (lambda: nn.Conv1d(2, 2, 3, padding=3), (2, 2, 5)),
    "conv2d-pad1": (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 4, 4)),
    "conv2d-stride-pad-tuples": (
        lambda: nn.Conv2d(2, 2, (3, 2), stride=(2, 1), padding=(1, 0)),
        (2, 2, 5, 4),
    ),
    "conv2d-dilation-groups2": (
        lambda: nn.Conv2d(4, 4, 3, dilation=(2, 1), padding=(2, 1), groups=2),
        (1, 4, 5, 4),
    ),
    "conv2d-depthwise": (lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3), (1, 3, 4, 3)),
    "conv2d-same-even-kernel": (lambda: nn.Conv2d(2, 2, (2, 4), padding="same"), (1, 2, 4, 5)),
    "conv2d-unbatched-nobias": (lambda: nn.Conv2d(2, 2, 2, bias=False), (2, 3, 4)),
    "conv3d-stride-pad": (
        lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1), padding=(1, 0, 1)),
        (1, 2, 3, 4, 3),
    ),
    "conv3d-same-even-nobias": (
        lambda: nn.Conv3d(2, 2, 2, padding="same", bias=False),
        (1, 2, 3, 3, 3),
    ),
    "convT1d": (lambda: nn.ConvTranspose1d(2, 3, 3), (2, 2, 5)),
    "convT1d-stride2-pad1-outpad1": (
        lambda: nn.ConvTranspose1d(2, 2, 3, stride=2, padding=1, output_padding=1),
        (2, 2, 4),
    ),
    "convT1d-dilation2-outpad1": (
        lambda: nn.ConvTranspose1d(2, 2, 3, dilation=2, output_padding=1),
        (2, 2, 4),
    ),
    "convT1d-groups2-nobias": (
        lambda: nn.ConvTranspose1d(4, 2, 3, groups=2, bias=False),
        (2, 4, 4),
    ),
    "convT1d-unbatched": (lambda: nn.ConvTranspose1d(2, 3, 2, stride=2), (2, 4)),
    "convT2d-stride2-pad1-outpad": (
        lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=(1, 0)),
        (1, 2, 3, 3),
    ),
    "convT2d-groups2-dilation-stride": (
        lambda: nn.ConvTranspose2d(4, 6, (2, 3), stride=(2, 1), dilation=(1, 2), groups=2),
        (1, 4, 3, 3),
    ),
    "convT3d-stride2": (
        lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, padding=(0, 1, 0)),
        (1, 2, 2, 3, 2),
    ),
}


@pytest.fixture(params=["fused", "forward-conv"])
def input_kernel(request, monkeypatch):
    """Which way the input diagonal is computed (the CPU timing would choose one)."""
    monkeypatch.setattr(conv_rules, "_SPLIT_FASTER", {})
    monkeypatch.setattr(_kernels, "faster", lambda a, b: request.param == "forward-conv")
    return request.param


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_conv_rule_matches_jacrev(case, input_kernel):
    make, shape = case
    module = make()
    assert_rule_matches(ConvRule(), module, torch.randn(shape))
    # The forward convolution applies at stride 1 with padding ≤ dilation · (kernel − 1).
    reach = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
    padding = [0] * len(reach) if isinstance(module.padding, str) else module.padding
    applies = set(module.stride) == {1} and all(map(int.__le__, padding, reach))
    chosen = set(conv_rules._SPLIT_FASTER.values())
    if applies and not module.transposed:  # the chosen kernel served
        assert chosen == {input_kernel == "forward-conv"}
    else:
        assert chosen == {False}  # the fused kernel, without a timing


def test_input_kernels_are_not_timed_in_deterministic_mode(monkeypatch):
    monkeypatch.setattr(conv_rules, "_SPLIT_FASTER", {})
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 5, 5)
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert_rule_matches(ConvRule(), conv, x)
    finally:
        torch.use_deterministic_algorithms(mode)
    assert conv_rules._SPLIT_FASTER == {}


def test_input_kernel_choice_is_timed_once_per_signature(monkeypatch):
    monkeypatch.setattr(conv_rules, "_SPLIT_FASTER", {})
    conv = nn.Conv2d(2, 3, 3, padding=1)
    for n in (2, 2, 3):
        x = torch.randn(n, 2, 5, 5)
        y = conv(x).detach()
        ConvRule().backward(conv, x, y, torch.rand_like(y))
    assert len(conv_rules._SPLIT_FASTER) == 2  # batch 2 once, batch 3 once


# Non-zero padding modes: name -> factory taking the mode, and the input shape.
PADDED = {
    "conv1d-pad2": (lambda mode: nn.Conv1d(2, 2, 3, padding=2, padding_mode=mode), (2, 2, 5)),
    "conv2d-pad-tuple-stride2-groups2": (
        lambda mode: nn.Conv2d(4, 2, 3, stride=2, padding=(1, 2), groups=2, padding_mode=mode),
        (1, 4, 4, 5),
    ),
    "conv2d-same-even-kernel": (
        lambda mode: nn.Conv2d(2, 2, (4, 3), padding="same", padding_mode=mode),
        (1, 2, 4, 3),
    ),
    "conv3d-pad1-nobias": (
        lambda mode: nn.Conv3d(1, 2, 2, padding=1, bias=False, padding_mode=mode),
        (1, 1, 2, 3, 2),
    ),
}
MODES = ["reflect", "replicate", "circular"]


def _split(module: nn.Module, mode: str):
    """The padding layer and the unpadded convolution that follows it, as plain functions."""
    pad = module._reversed_padding_repeated_twice
    conv = getattr(F, f"conv{len(module.kernel_size)}d")
    W = module.weight.detach()
    b = None if module.bias is None else module.bias.detach()

    def pad_fn(t):
        return F.pad(t, pad, mode=mode)

    def conv_fn(t):
        return conv(t, W, b, module.stride, 0, module.dilation, module.groups)

    return pad_fn, conv_fn


def _pad_vjp(pad_fn, x, m_pad):
    _, vjp = torch.func.vjp(pad_fn, x)
    return vjp(m_pad)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", PADDED.values(), ids=PADDED.keys())
def test_padding_mode_is_pad_layer_then_conv(case, mode, input_kernel):
    # input_kernel: the same way for input_rule and backward (each signature is timed on its
    # own, and the two ways round differently; they are compared bit for bit below).
    make, shape = case
    module, x = make(mode), torch.randn(shape)
    with torch.no_grad():
        y = module(x)
    m_out = torch.rand_like(y)
    pad_fn, conv_fn = _split(module, mode)
    torch.testing.assert_close(conv_fn(pad_fn(x)), y, rtol=1e-12, atol=1e-12)
    # (a) DB through the unpadded convolution at the padded input, (b) the pad's VJP.
    m_pad = squared_input_rule(conv_fn, pad_fn(x), m_out)
    expected = _pad_vjp(pad_fn, x, m_pad)

    rule = ConvRule()
    m_in, diags = rule.backward(module, x, y, m_out)
    assert m_in.shape == x.shape
    torch.testing.assert_close(m_in, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rule.input_rule(module, x, y, m_out), m_in, rtol=0, atol=0)
    assert (m_in >= 0).all()
    # The parameters see no diagonal in between: exact for the whole module.
    expected_p = squared_param_rule(module, x, m_out)
    assert set(diags) == set(expected_p)
    for k, d in rule.param_rule(module, x, y, m_out).items():
        torch.testing.assert_close(d, expected_p[k], rtol=1e-10, atol=1e-12, msg=k)
        torch.testing.assert_close(diags[k], d, rtol=0, atol=0, msg=k)


def test_reflect_padding_granularity_differs_from_module_level():
    module = nn.Conv1d(1, 1, 3, padding=2, padding_mode="reflect")
    x = torch.randn(1, 1, 5)
    with torch.no_grad():
        y = module(x)
    m_out = torch.rand_like(y)
    m_in = ConvRule().input_rule(module, x, y, m_out)
    module_level = squared_input_rule(module, x, m_out)
    # Positions 0 and 4 have a single copy in the padded input and agree; the reflected
    # positions 1-3 appear twice, so the split rule (diagonal in between) differs.
    torch.testing.assert_close(m_in[..., [0, 4]], module_level[..., [0, 4]])
    assert not torch.allclose(m_in[..., 1:4], module_level[..., 1:4])


def test_conv_transpose_with_output_size():
    module = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    x = torch.randn(2, 2, 3, 3)
    size = [6, 5]  # output_padding (1, 0), inferred from the output's shape

    def fn(t):
        return module(t, output_size=size)

    with torch.no_grad():
        y = fn(x)
    m_out = torch.rand_like(y)
    m_in, diags = ConvRule().backward(module, x, y, m_out)
    torch.testing.assert_close(m_in, squared_input_rule(fn, x, m_out), rtol=1e-10, atol=1e-12)
    weight_jac = torch.func.jacrev(lambda W: F.conv_transpose2d(x, W, module.bias, 2, 1, (1, 0)))(
        module.weight.detach()
    ).reshape(y.numel(), -1)
    expected_w = (weight_jac.square().T @ m_out.reshape(-1)).reshape(module.weight.shape)
    torch.testing.assert_close(diags["weight"], expected_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(diags["bias"], m_out.sum((0, 2, 3)))


@pytest.mark.parametrize(
    "case", [CASES["conv2d-dilation-groups2"], CASES["convT1d"]], ids=["conv2d", "convT1d"]
)
def test_backward_without_input(case):
    make, shape = case
    module, x = make(), torch.randn(shape)
    with torch.no_grad():
        y = module(x)
    m_out = torch.rand_like(y)
    m_in, diags = ConvRule().backward(module, x, y, m_out, need_input=False)
    assert m_in is None
    expected = squared_param_rule(module, x, m_out)
    assert set(diags) == {"weight", "bias"} == set(expected)
    for k, d in diags.items():
        torch.testing.assert_close(d, expected[k], rtol=1e-10, atol=1e-12, msg=k)


def test_backward_without_params():
    module, x = nn.Conv2d(2, 3, 2, stride=2), torch.randn(2, 2, 4, 4)
    with torch.no_grad():
        y = module(x)
    m_out = torch.rand_like(y)
    m_in, diags = ConvRule().backward(module, x, y, m_out, need_params=False)
    assert diags == {}
    torch.testing.assert_close(m_in, squared_input_rule(module, x, m_out), rtol=1e-10, atol=1e-12)
    assert ConvRule().backward(module, x, y, m_out, need_input=False, need_params=False) == (
        None,
        {},
    )


def _softmax_block(y: torch.Tensor) -> torch.Tensor:
    """Per-position ``diag(p) - p p^T`` of shape ``[N, C, C, *spatial]`` for logits like ``y``."""
    p = torch.softmax(torch.randn_like(y), 1).movedim(1, -1)
    h = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
    return h.movedim(-2, 1).movedim(-1, 2)


BLOCK_CASES = {
    "conv2d-1x1-head": (lambda: nn.Conv2d(3, 4, 1), (2, 3, 3, 3)),
    "conv2d-pad1-groups2": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=2), (1, 4, 3, 4)),
    "conv1d-stride2-dilation2": (lambda: nn.Conv1d(2, 3, 3, stride=2, dilation=2), (2, 2, 9)),
    "conv2d-same-even-kernel": (
        lambda: nn.Conv2d(2, 3, (2, 3), padding="same", bias=False),
        (1, 2, 3, 4),
    ),
    "conv3d-pad1": (lambda: nn.Conv3d(2, 2, 2, padding=1), (1, 2, 2, 2, 2)),
    "convT1d-stride2-groups2-outpad": (
        lambda: nn.ConvTranspose1d(4, 4, 3, stride=2, groups=2, output_padding=1),
        (2, 4, 3),
    ),
    "convT2d-stride2-pad1": (
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1),
        (1, 2, 2, 3),
    ),
}


@pytest.mark.parametrize("case", BLOCK_CASES.values(), ids=BLOCK_CASES.keys())
def test_conv_block_rule_matches_dense(case):
    make, shape = case
    module, x = make(), torch.randn(shape)
    with torch.no_grad():
        y = module(x)
    h = _softmax_block(y)
    h0 = h.clone()
    m_in = ConvRule().input_rule_block(module, x, y, h)
    assert m_in.shape == x.shape
    torch.testing.assert_close(m_in, block_input_rule(module, x, h), rtol=1e-10, atol=1e-12)
    assert (m_in >= -1e-12).all()
    torch.testing.assert_close(h, h0, rtol=0, atol=0)


def test_conv_block_rule_with_diagonal_block_is_input_rule():
    module, x = nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2), torch.randn(2, 4, 2, 3)
    with torch.no_grad():
        y = module(x)
    m_out = torch.rand_like(y)
    h = torch.diag_embed(m_out.movedim(1, -1)).movedim(-2, 1).movedim(-1, 2)
    rule = ConvRule()
    torch.testing.assert_close(
        rule.input_rule_block(module, x, y, h), rule.input_rule(module, x, y, m_out)
    )


def test_conv_block_rule_unbatched():
    module, x = nn.Conv2d(2, 3, 3, padding=1), torch.randn(2, 3, 4)
    with torch.no_grad():
        y = module(x)
    h = _softmax_block(y[None])
    m_in = ConvRule().input_rule_block(module, x, y, h[0])
    assert m_in.shape == x.shape
    expected = block_input_rule(module, x[None], h)[0]
    torch.testing.assert_close(m_in, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_conv_block_rule_padding_mode_is_pad_layer_then_conv(mode):
    module = nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode=mode)
    x = torch.randn(1, 2, 3, 4)
    with torch.no_grad():
        y = module(x)
    h = _softmax_block(y)
    pad_fn, conv_fn = _split(module, mode)
    expected = _pad_vjp(pad_fn, x, block_input_rule(conv_fn, pad_fn(x), h))
    m_in = ConvRule().input_rule_block(module, x, y, h)
    torch.testing.assert_close(m_in, expected, rtol=1e-10, atol=1e-12)


def test_rejects_wrong_rank():
    module = nn.Conv2d(2, 2, 3)
    x = torch.randn(1, 1, 2, 5, 5)
    with pytest.raises(ValueError, match="2 spatial dims"):
        ConvRule().input_rule(module, x, x, x)


def test_rejects_wrong_channels():
    module = nn.Conv1d(2, 3, 3)
    x = torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match="does not fit"):
        ConvRule().backward(module, x, torch.zeros(2, 3, 3), torch.zeros(2, 3, 3))


def test_rejects_curvature_of_wrong_spatial_size():
    module = nn.Conv1d(2, 3, 3, stride=2)
    x = torch.randn(2, 2, 7)
    with pytest.raises(ValueError, match="spatial size"):
        ConvRule().input_rule(module, x, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))


def test_block_rule_rejects_wrong_block_shape():
    module = nn.Conv2d(2, 3, 1)
    x = torch.randn(1, 2, 3, 3)
    y = module(x).detach()
    with pytest.raises(ValueError, match="h_block must have shape"):
        ConvRule().input_rule_block(module, x, y, torch.zeros(1, 3, 3, 3))


def test_rejects_non_convolution():
    with pytest.raises(TypeError, match="convolution"):
        ConvRule().input_rule(nn.Linear(2, 2), torch.zeros(1, 2), torch.zeros(1, 2), None)
