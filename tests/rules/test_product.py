import pytest
import torch
from torch import nn

import lsn_ext
from lsn_ext.exact import exact_ggn_diagonal
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy
from lsn_ext.rules.product import product_forward_rule, product_rule
from tests.networks import GraphNet
from tests.reference import dense_db, dense_forward, squared_forward_input_rule, squared_input_rule

SHAPES = {
    "same-shape": ((2, 3, 4), (2, 3, 4)),
    "gate-map-broadcast-over-channels": ((2, 3, 4, 4), (2, 1, 4, 4)),
    "channel-weights-broadcast-over-space": ((2, 3, 4, 4), (2, 3, 1, 1)),
    "both-broadcast": ((2, 1, 4), (2, 3, 1)),
}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_product_rule_matches_jacrev_for_each_factor(shapes):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    m = torch.rand(torch.broadcast_shapes(a.shape, b.shape))
    m_a, m_b = product_rule(m, a, b)
    torch.testing.assert_close(m_a, squared_input_rule(lambda z: z * b, a, m), rtol=1e-12, atol=0)
    torch.testing.assert_close(m_b, squared_input_rule(lambda z: a * z, b, m), rtol=1e-12, atol=0)


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_product_forward_rule_matches_jacrev(shapes):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    v_a, v_b = torch.rand_like(a), torch.rand_like(b)
    want = squared_forward_input_rule(lambda z: z * b, a, v_a)
    want = want + squared_forward_input_rule(lambda z: a * z, b, v_b)
    torch.testing.assert_close(product_forward_rule(v_a, v_b, a, b), want, rtol=1e-12, atol=0)
    only_b = product_forward_rule(None, v_b, a, b)
    torch.testing.assert_close(only_b, squared_forward_input_rule(lambda z: a * z, b, v_b))
    assert (product_forward_rule(None, None, a, b) == 0).all()


def attention_gate_net(out_channels: int = 1) -> GraphNet:
    """An attention gate (MONAI AttentionUnet style) and a squeeze-excitation scaling."""
    layers = {
        "f": nn.Conv2d(2, 3, 3, padding=1),
        "g": nn.Conv2d(3, 1, 1),
        "se": nn.Conv2d(3, 3, 1),
        "head": nn.Conv2d(3, out_channels, 1),
    }
    nodes = [
        ("h", "f", ("x",)),
        ("a", torch.tanh, ("h",)),
        ("psi", lambda t: torch.sigmoid(t), ("gq",)),
        ("gated", torch.mul, ("a", "psi")),
        ("pooled", lambda t: t.mean((2, 3), keepdim=True), ("gated",)),
        ("w", torch.sigmoid, ("sw",)),
        ("excited", lambda u, v: u * v, ("gated", "w")),
        ("out", "head", ("excited",)),
    ]
    # "gq" and "sw" are the outputs of the 1×1 convolutions g and se.
    nodes.insert(2, ("gq", "g", ("a",)))
    nodes.insert(6, ("sw", "se", ("pooled",)))
    return GraphNet(layers, nodes, "out")


def test_gated_network_matches_dense_layerwise_reference():
    net = attention_gate_net()
    x = torch.randn(2, 2, 5, 5)
    y = (torch.rand(2, 1, 5, 5) > 0.5).double()
    loss = BCEWithLogits()
    res = lsn_ext.diag_backprop(net, x, y, loss)
    want = dense_db(net, x, loss.hessian_diag(net(x).detach(), y))
    for k, d in want.items():
        torch.testing.assert_close(res.diagonals[k], d, rtol=1e-10, atol=1e-12, msg=k)
        assert (res.diagonals[k] >= 0).all()


def test_gated_network_cross_entropy_head_is_exact():
    net = attention_gate_net(3)
    x = torch.randn(2, 2, 4, 4)
    y = torch.randint(0, 3, (2, 4, 4))
    res = lsn_ext.diag_backprop(net, x, y, CrossEntropy())
    exact = exact_ggn_diagonal(net, x, y, CrossEntropy())
    for k in ("layers.head.weight", "layers.head.bias"):
        torch.testing.assert_close(res.diagonals[k], exact[k], rtol=1e-10, atol=1e-12)


def test_gated_network_linearized_variance_matches_dense_forward_reference():
    net = attention_gate_net()
    x = torch.randn(2, 2, 5, 5)
    var = {n: torch.rand_like(p) for n, p in net.named_parameters()}
    mean, v = lsn_ext.linearized_variance(net, x, var)
    torch.testing.assert_close(mean, net(x).detach())
    torch.testing.assert_close(v, dense_forward(net, x, var), rtol=1e-10, atol=1e-12)
