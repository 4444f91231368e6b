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
