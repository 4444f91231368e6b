import functools

import pytest
import torch
from torch import nn

from lsn_ext.models import UNet

CONFIGS = {
    "paper-default": ({}, (2, 3, 32, 32), 1),
    "3-level-relu-bilinear": (
        {"widths": (4, 8, 16), "activation": nn.ReLU, "upsampling": "bilinear"},
        (1, 3, 8, 12),
        1,
    ),
    "2-level-transposed-ce": ({"widths": (2, 3), "upsampling": "transposed"}, (2, 3, 4, 6), 4),
    "1-level": ({"widths": (5,)}, (1, 3, 3, 5), 2),
    "3-convs-leaky-dropout": (
        {
            "widths": (2, 4),
            "convs_per_block": 3,
            "activation": functools.partial(nn.LeakyReLU, 0.1),
            "dropout": 0.5,
        },
        (2, 3, 4, 4),
        1,
    ),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_output_shape_and_gradient(config):
    kwargs, shape, out_channels = config
    net = UNet(shape[1], out_channels, **kwargs).eval()  # eval: no dropped channels
    x = torch.randn(shape)
    y = net(x)
    assert y.shape == (shape[0], out_channels, *shape[2:])
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_default_is_paper_backbone():
    net = UNet(3, 1)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs[:10]] == [8, 8, 16, 16, 32, 32, 64, 64, 128, 128]
    assert [c.out_channels for c in convs[10:]] == [64, 64, 32, 32, 16, 16, 8, 8, 1]
    assert sum(isinstance(m, nn.Tanh) for m in net.modules()) == 18
    assert all(m.mode == "nearest" for m in net.modules() if isinstance(m, nn.Upsample))
    assert not any(isinstance(m, nn.Dropout2d) for m in net.modules())


def test_activations_are_distinct_modules():
    net = UNet(1, 1, widths=(2, 3, 4))
    acts = [m for m in net.modules() if isinstance(m, nn.Tanh)]
    assert len(acts) == 10
    assert len({id(a) for a in acts}) == len(acts)


def test_dropout_is_active_only_in_train_mode():
    net = UNet(1, 1, widths=(3, 4), dropout=0.5)
    x = torch.randn(2, 1, 4, 4)
    assert sum(isinstance(m, nn.Dropout2d) for m in net.modules()) == 6  # 3 blocks × 2
    net.eval()
    torch.testing.assert_close(net(x), net(x))
    net.train()
    assert not torch.allclose(net(x), net(x))


def test_skip_connection_is_used():
    # With the bottleneck's output zeroed the top level still reaches the output via the skip.
    net = UNet(1, 1, widths=(2, 3))
    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    net(x).sum().backward()
    assert x.grad.abs().sum() > 0
    assert net.decoders[0][0].in_channels == 2 + 3


BAD_ARGS = {
    "zero-in": ({"in_channels": 0, "out_channels": 1}, ValueError, "in_channels"),
    "float-out": ({"in_channels": 1, "out_channels": 1.0}, ValueError, "out_channels"),
    "empty-widths": ({"in_channels": 1, "out_channels": 1, "widths": ()}, ValueError, "widths"),
    "negative-width": (
        {"in_channels": 1, "out_channels": 1, "widths": (4, -2)},
        ValueError,
        "widths",
    ),
    "zero-convs": (
        {"in_channels": 1, "out_channels": 1, "convs_per_block": 0},
        ValueError,
        "convs_per_block",
    ),
    "unknown-upsampling": (
        {"in_channels": 1, "out_channels": 1, "upsampling": "bicubic"},
        ValueError,
        "upsampling",
    ),
    "dropout-one": ({"in_channels": 1, "out_channels": 1, "dropout": 1.0}, ValueError, "dropout"),
    "functional-activation": (
        {"in_channels": 1, "out_channels": 1, "activation": lambda: torch.tanh},
        TypeError,
        "nn.Module",
    ),
}


@pytest.mark.parametrize("case", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments(case):
    kwargs, error, match = case
    with pytest.raises(error, match=match):
        UNet(**kwargs)


BAD_INPUTS = {
    "not-divisible": ((1, 3, 10, 16), r"divisible by 2\*\*2 = 4.*\(1, 3, 10, 16\)"),
    "three-dims": ((3, 16, 16), r"\[N, C, H, W\]"),
    "wrong-channels": ((1, 2, 16, 16), "3 input channels"),
}


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs(case):
    shape, match = case
    net = UNet(3, 1, widths=(2, 3, 4))
    with pytest.raises(ValueError, match=match):
        net(torch.zeros(shape))


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            {"image": torch.zeros(1, 3, 16, 16)},
            r"dictionary batch \(keys \['image'\]\).*"
            r"lsn_ext.SelectInput\(unet, 'image'\)",
        ),
        ([torch.zeros(1, 3, 16, 16)], r"image tensor \[N, C, H, W\], got a list"),
    ],
    ids=["dictionary", "list"],
)
def test_a_batch_that_is_not_a_tensor_is_refused_with_the_remedy(batch, match):
    """A dictionary batch said ``'dict' object has no attribute 'dim'``."""
    with pytest.raises(TypeError, match=match):
        UNet(3, 1, widths=(2, 3, 4))(batch)


def test_symbolic_tracing_skips_the_input_checks_and_keeps_the_network():
    """torch.fx (BackPACK's converter) traces the U-Net; real inputs are still checked."""
    net = UNet(3, 2, widths=(4, 8)).eval()
    traced = torch.fx.symbolic_trace(net)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(traced(x), net(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="UNet expects images"):
        net(torch.randn(3, 16, 16))
