"""Small test networks: ordinary ``nn.Module`` s whose forward executes a node list.

The same node list drives the dense references in :mod:`tests.reference`, so network and
reference cannot drift apart. Nodes are ``(output_name, op, input_names)``; ``op`` is the name of
a submodule or a plain function of tensors (``torch.cat`` and friends).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class GraphNet(nn.Module):
    def __init__(self, layers: dict[str, nn.Module], nodes: list, output: str):
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.nodes = nodes
        self.output = output

    def op(self, op: str | Callable):
        return self.layers[op] if isinstance(op, str) else op

    def forward(self, x):
        values = {"x": x}
        for out, op, ins in self.nodes:
            values[out] = self.op(op)(*[values[i] for i in ins])
        return values[self.output]


def cat(*xs):
    return torch.cat(xs, dim=1)


def tiny_unet(out_channels=1, up="bilinear", order="skip-first", act=nn.Tanh) -> GraphNet:
    """Three levels, nested concatenating skips, conv/act/max-pool/upsampling, 1×1 head."""
    w = (3, 4, 5)
    up_layer = {
        "bilinear": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
        "nearest": lambda: nn.Upsample(scale_factor=2, mode="nearest"),
        "transposed": None,
    }[up]

    def merge(skip, upsampled):
        return (skip, upsampled) if order == "skip-first" else (upsampled, skip)

    layers = {
        "e1": nn.Conv2d(2, w[0], 3, padding=1), "a1": act(), "p1": nn.MaxPool2d(2),
        "e2": nn.Conv2d(w[0], w[1], 3, padding=1), "a2": act(), "p2": nn.MaxPool2d(2),
        "b": nn.Conv2d(w[1], w[2], 3, padding=1), "ab": act(),
        "d2": nn.Conv2d(w[1] + w[2], w[1], 3, padding=1), "ad2": act(),
        "d1": nn.Conv2d(w[0] + w[1], w[0], 3, padding=1), "ad1": act(),
        "head": nn.Conv2d(w[0], out_channels, 1),
    }  # fmt: skip
    if up == "transposed":
        layers["u2"] = nn.ConvTranspose2d(w[2], w[2], 2, stride=2)
        layers["u1"] = nn.ConvTranspose2d(w[1], w[1], 2, stride=2)
    else:
        layers["u2"], layers["u1"] = up_layer(), up_layer()
    nodes = [
        ("h1", "e1", ("x",)), ("s1", "a1", ("h1",)), ("q1", "p1", ("s1",)),
        ("h2", "e2", ("q1",)), ("s2", "a2", ("h2",)), ("q2", "p2", ("s2",)),
        ("hb", "b", ("q2",)), ("sb", "ab", ("hb",)),
        ("ub", "u2", ("sb",)), ("c2", cat, merge("s2", "ub")),
        ("g2", "d2", ("c2",)), ("t2", "ad2", ("g2",)),
        ("u1o", "u1", ("t2",)), ("c1", cat, merge("s1", "u1o")),
        ("g1", "d1", ("c1",)), ("t1", "ad1", ("g1",)),
        ("out", "head", ("t1",)),
    ]  # fmt: skip
    return GraphNet(layers, nodes, "out")


def residual_net() -> GraphNet:
    """Additive residual, subtraction, constant scaling, functional ops, crop, pad, 3-way cat."""
    layers = {
        "c1": nn.Conv2d(2, 3, 3, padding=1),
        "c2": nn.Conv2d(3, 3, 3, padding=1),
        "bn": nn.BatchNorm2d(3),
        "c3": nn.Conv2d(9, 2, 3, padding=0),
    }
    nodes = [
        ("h", "c1", ("x",)),
        ("t", torch.tanh, ("h",)),
        ("f", "c2", ("t",)),
        ("r", torch.add, ("t", "f")),
        ("d", torch.sub, ("r", "h")),
        ("s", lambda a: 0.5 * a, ("d",)),
        ("g", F.silu, ("s",)),
        ("n", "bn", ("g",)),
        ("q", lambda a: F.avg_pool2d(a, 2), ("n",)),
        ("u", lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), ("q",)),
        ("k", cat, ("u", "g", "t")),
        ("o", lambda a: F.pad(a, (1, 1, 1, 1)), ("k",)),
        ("z", lambda a: a / 3.0, ("o",)),
        ("out", "c3", ("z",)),
    ]
    return GraphNet(layers, nodes, "out")


def classifier() -> GraphNet:
    """Conv → ReLU → global mean → flatten → Linear head, ``[N, K]`` logits."""
    layers = {"c": nn.Conv2d(2, 4, 3), "r": nn.ReLU(), "fl": nn.Flatten(), "fc": nn.Linear(4, 3)}
    nodes = [
        ("h", "c", ("x",)),
        ("a", "r", ("h",)),
        ("m", lambda a: a.mean((2, 3)), ("a",)),
        ("v", "fl", ("m",)),
        ("out", "fc", ("v",)),
    ]
    return GraphNet(layers, nodes, "out")


# -- networks that share modules or parameters (lsn_ext._functional) --------------------------


class PlainNet(nn.Module):
    """Conv → batch norm (eval statistics) → tanh → 1×1 conv: two logit channels."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.bn.running_mean.normal_()
        self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.stem(x))))


class AliasNet(PlainNet):
    """:class:`PlainNet` whose stem and batch norm are also registered under a second name.

    ``forward`` uses the second names, ``named_parameters()`` reports the first ones (as in
    MONAI's ``DynUNet`` and the nnU-Net networks of ``dynamic_network_architectures``).
    """

    def __init__(self):
        super().__init__()
        self.stem_alias = self.stem
        self.bn_alias = self.bn

    def forward(self, x):
        return self.head(torch.tanh(self.bn_alias(self.stem_alias(x))))


class TiedNet(nn.Module):
    """Two 3×3 convolutions holding the same weight ``Parameter`` (own biases)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.mid2 = nn.Conv2d(4, 4, 3, padding=1)
        self.mid2.weight = self.mid.weight
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.mid2(h)))


def tiny_dynunet() -> nn.Module:
    """MONAI ``DynUNet``, 2-D, 3 levels (4/8/16 filters), instance norm, 2 classes."""
    from monai.networks.nets import DynUNet

    return DynUNet(
        spatial_dims=2,
        in_channels=1,
        out_channels=2,
        kernel_size=[3, 3, 3],
        strides=[1, 2, 2],
        upsample_kernel_size=[2, 2],
        filters=[4, 8, 16],
    )


def tiny_plain_conv_unet() -> nn.Module:
    """nnU-Net's ``PlainConvUNet``, 2-D, 3 stages (4/8/16), affine instance norm, 2 classes."""
    from dynamic_network_architectures.architectures.unet import PlainConvUNet

    return PlainConvUNet(
        input_channels=1,
        n_stages=3,
        features_per_stage=[4, 8, 16],
        conv_op=nn.Conv2d,
        kernel_sizes=3,
        strides=[1, 2, 2],
        n_conv_per_stage=1,
        num_classes=2,
        n_conv_per_stage_decoder=1,
        conv_bias=True,
        norm_op=nn.InstanceNorm2d,
        norm_op_kwargs={"affine": True, "eps": 1e-5},
        nonlin=nn.LeakyReLU,
        nonlin_kwargs={"inplace": True},
    )


SHARING_NETS: dict[str, Callable[[], nn.Module]] = {
    "plain": PlainNet,
    "alias": AliasNet,
    "tied": TiedNet,
    "dynunet": tiny_dynunet,
    "plainconvunet": tiny_plain_conv_unet,
}
"""Builders of two-class ``[N, 1, 16, 16] → [N, 2, 16, 16]`` networks, by readable id."""


def perturb_norms(model: nn.Module) -> nn.Module:
    """Random affine parameters for every norm layer (their defaults 1 and 0 hide mistakes)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    return model
