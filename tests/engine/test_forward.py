"""``linearized_variance``: whole networks against dense forward references."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from lsn_ext.engine.forward import linearized_variance
from lsn_ext.models import UNet
from tests.engine.test_diag_backprop import (
    ERRORS,
    FUNCTIONAL,
    NORM_NETS,
    REFUSED,
    PlainUNet,
    assert_unchanged,
    eval_mode,
    norm_net,
    randomise_norm_and_act,
    snapshot,
)
from tests.networks import GraphNet, cat, classifier, residual_net, tiny_unet
from tests.reference import dense_forward, exact_linearized_variance

TOL = {"rtol": 1e-10, "atol": 1e-12}


def random_variance(net: nn.Module, scale: float = 0.01) -> dict[str, torch.Tensor]:
    return {n: scale * torch.rand_like(p) for n, p in net.named_parameters()}


def flat(net: nn.Module, var: dict) -> torch.Tensor:
    return torch.cat([var[n].reshape(-1) for n, p in net.named_parameters() if p.requires_grad])


def check_against_dense(net: GraphNet, x: torch.Tensor, var: dict) -> torch.Tensor:
    mean, v = linearized_variance(net, x, var)
    torch.testing.assert_close(mean, net(x).detach(), **TOL)
    torch.testing.assert_close(v, dense_forward(net, x, var), **TOL)
    assert (v >= 0).all()
    return v


UNETS = {
    f"{up}-{order}": (up, order)
    for up in ("bilinear", "nearest", "transposed")
    for order in ("skip-first", "up-first")
}


@pytest.mark.parametrize("case", UNETS.values(), ids=UNETS.keys())
def test_unet_matches_dense_forward_reference(case):
    net = tiny_unet(2, *case)
    x = torch.randn(2, 2, 8, 8)
    check_against_dense(net, x, random_variance(net))


def test_residual_and_functional_ops_match_dense_forward_reference():
    net = eval_mode(residual_net())
    check_against_dense(net, torch.randn(2, 2, 8, 8), random_variance(net))


def test_classifier_nk_logits_matches_dense_forward_reference():
    net = classifier()
    v = check_against_dense(net, torch.randn(5, 2, 6, 6), random_variance(net))
    assert v.shape == (5, 3)


@pytest.mark.parametrize("middle", FUNCTIONAL.values(), ids=FUNCTIONAL.keys())
def test_functional_operations_match_dense_forward_reference(middle):
    net = GraphNet(
        {"c": nn.Conv2d(2, 3, 3, padding=1), "head": nn.Conv2d(3, 2, 1)},
        [("h", "c", ("x",)), *middle, ("out", "head", ("g",))],
        "out",
    )
    check_against_dense(net, torch.randn(2, 2, 6, 6), random_variance(net))


def test_plain_unet_with_inplace_activations_matches_dense_forward_reference():
    net = PlainUNet()
    x = torch.randn(2, 2, 8, 8)
    var = random_variance(net)
    mean, v = linearized_variance(net, x, var)
    graph = net.graph()
    graph_var = dict(zip([n for n, _ in graph.named_parameters()], var.values(), strict=True))
    torch.testing.assert_close(v, dense_forward(graph, x, graph_var), **TOL)
    torch.testing.assert_close(mean, net(x).detach(), rtol=0, atol=0)


def test_module_called_twice_sums_both_uses():
    net = GraphNet(
        {"c": nn.Conv2d(2, 2, 3, padding=1), "a": nn.Tanh(), "head": nn.Conv2d(4, 1, 1)},
        [
            ("h", "c", ("x",)),
            ("t", "a", ("h",)),
            ("h2", "c", ("t",)),
            ("k", cat, ("t", "h2")),
            ("out", "head", ("k",)),
        ],
        "out",
    )
    check_against_dense(net, torch.randn(2, 2, 6, 6), random_variance(net))


@pytest.mark.parametrize("make", NORM_NETS.values(), ids=NORM_NETS.keys())
def test_norm_networks_match_dense_forward_reference(make):
    net, graph = norm_net(make)
    x = torch.randn(2, 2, 6, 6)
    var = random_variance(net)
    mean, v = linearized_variance(net, x, var)
    torch.testing.assert_close(mean, graph(x).detach(), rtol=0, atol=0)
    graph_var = dict(zip((n for n, _ in graph.named_parameters()), var.values(), strict=True))
    torch.testing.assert_close(v, dense_forward(graph, x, graph_var), **TOL)
    assert (v >= 0).all()


def _norm_prelu(norm: nn.Module) -> nn.Sequential:
    net = nn.Sequential(norm, nn.PReLU(2), nn.Tanh())
    randomise_norm_and_act(net[0], net[1])
    return net


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(2, 3, 3, padding=1),
        lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(32, 3)),
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Sigmoid()),
        lambda: _norm_prelu(nn.InstanceNorm2d(2, affine=True)),
        lambda: _norm_prelu(nn.GroupNorm(1, 2)),
        lambda: _norm_prelu(nn.LayerNorm([2, 4, 4])),
    ],
    ids=[
        "conv",
        "conv-circular",
        "linear",
        "conv-elementwise-tail",
        "instancenorm-prelu-tanh",
        "groupnorm-prelu-tanh",
        "layernorm-prelu-tanh",
    ],
)
def test_exact_for_a_single_parametric_layer(make):
    net = make()
    x = torch.randn(3, 2, 4, 4)
    var = random_variance(net, 1.0)
    _, v = linearized_variance(net, x, var)
    torch.testing.assert_close(v, exact_linearized_variance(net, x, var), **TOL)


def test_exact_for_the_last_layers_own_contribution_and_approximate_below():
    net = tiny_unet(2)
    x = torch.randn(2, 2, 8, 8)
    head = {n: v for n, v in random_variance(net, 1.0).items() if n.startswith("layers.head")}
    _, v = linearized_variance(net, x, head)
    torch.testing.assert_close(v, exact_linearized_variance(net, x, head), **TOL)
    # With every layer's variance, dropped covariances between activations make a difference.
    var = random_variance(net, 1.0)
    _, v = linearized_variance(net, x, var)
    exact = exact_linearized_variance(net, x, var)
    assert not torch.allclose(v, exact, rtol=1e-3)


def test_agrees_with_laplace_torch_glm_predictive_for_a_linear_model():
    from laplace import Laplace

    model = nn.Sequential(nn.Linear(4, 3))
    X, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=10)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(loader)
    la.prior_precision = 0.7
    f_mu, f_var = la._glm_predictive_distribution(X[:5])
    mean, var = linearized_variance(model, X[:5], la.posterior_variance)
    torch.testing.assert_close(mean, f_mu, **TOL)
    torch.testing.assert_close(var, torch.diagonal(f_var, dim1=-2, dim2=-1), **TOL)


def test_flat_vector_dict_and_missing_names():
    net = tiny_unet(1)
    x = torch.randn(2, 2, 8, 8)
    var = random_variance(net)
    _, from_dict = linearized_variance(net, x, var)
    _, from_flat = linearized_variance(net, [x], flat(net, var))
    torch.testing.assert_close(from_flat, from_dict, rtol=0, atol=0)
    partial = {n: v for n, v in var.items() if n.startswith("layers.d1")}
    zeros = {n: torch.zeros_like(v) for n, v in var.items() if not n.startswith("layers.d1")}
    _, v_partial = linearized_variance(net, x, partial)
    _, v_zeros = linearized_variance(net, x, {**partial, **zeros})
    torch.testing.assert_close(v_partial, v_zeros, **TOL)
    mean, v_none = linearized_variance(net, x, {})
    assert (v_none == 0).all()
    torch.testing.assert_close(mean, net(x).detach(), rtol=0, atol=0)


def test_frozen_parameters_are_left_out_of_the_flat_vector():
    net = tiny_unet(1)
    x = torch.randn(2, 2, 8, 8)
    net.layers["e1"].weight.requires_grad_(False)
    var = random_variance(net)
    _, v = linearized_variance(net, x, flat(net, var))
    del var["layers.e1.weight"]
    torch.testing.assert_close(v, dense_forward(net, x, var), **TOL)
    # A frozen parameter may still be given a variance by name.
    var["layers.e1.weight"] = torch.rand_like(net.layers["e1"].weight)
    _, v = linearized_variance(net, x, var)
    torch.testing.assert_close(v, dense_forward(net, x, var), **TOL)
    assert not net.layers["e1"].weight.requires_grad


def test_output_fn_selects_and_transforms_the_output():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(2, 1, 3, padding=1)

        def forward(self, x):
            return self.c(x), x

    net, x = Two(), torch.randn(2, 2, 5, 5)
    var = random_variance(net)
    with pytest.raises(TypeError, match=r"returned tuple.*output_fn"):
        linearized_variance(net, x, var)
    mean, v = linearized_variance(net, x, var, output_fn=lambda out: out[0])
    _, vp = linearized_variance(net, x, var, output_fn=lambda out: torch.sigmoid(out[0]))
    p = torch.sigmoid(mean)
    torch.testing.assert_close(vp, (p * (1 - p)).square() * v, **TOL)  # the delta method


def test_model_left_as_found_and_usable_with_torch_func():
    net = PlainUNet()
    x = torch.randn(2, 2, 8, 8)
    before = snapshot(net)
    linearized_variance(net, x, random_variance(net))
    assert_unchanged(net, before)
    params = {k: v.detach() for k, v in net.named_parameters()}
    jac = jacrev(lambda p: functional_call(net, p, (x[:1],)))(params)
    assert jac["head.bias"].shape == (1, 2, 8, 8, 2)


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_same_refusals_as_diag_backprop(case):
    make, err, pattern = case
    net = make()
    before = snapshot(net)
    with pytest.raises(err, match=pattern):
        linearized_variance(net, torch.randn(2, 2, 4, 4), random_variance(net))
    assert_unchanged(net, before)


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_unsupported_functional_operations_are_refused(case):
    fn, pattern = case
    net = GraphNet(
        {"c": nn.Conv2d(2, 3, 3, padding=1), "head": nn.Conv2d(3, 1, 1)},
        [("h", "c", ("x",)), ("g", fn, ("h",)), ("out", "head", ("g",))],
        "out",
    )
    with pytest.raises(NotImplementedError, match=pattern):
        linearized_variance(net, torch.randn(1, 2, 4, 4), random_variance(net))


def test_functional_nonlinearity_after_frozen_layer_with_variance_is_routed():
    # The frozen conv gets a variance by name: its output must still pass through the rules
    # (a native tanh JVP would give (1 - y²) v instead of (1 - y²)² v).
    net = GraphNet(
        {"c": nn.Conv2d(2, 2, 1)}, [("h", "c", ("x",)), ("out", torch.tanh, ("h",))], "out"
    )
    net.requires_grad_(False)
    x = torch.randn(1, 2, 3, 3)
    var = random_variance(net, 1.0)
    _, v = linearized_variance(net, x, var)
    torch.testing.assert_close(v, exact_linearized_variance(net, x, var), **TOL)


@pytest.mark.parametrize(
    ("variance", "err", "pattern"),
    [
        (torch.ones(5), ValueError, r"one entry per parameter with requires_grad \(27 for"),
        (torch.ones(27, 1), ValueError, r"got shape \(27, 1\)"),
        ({"head.weight": torch.ones(1)}, ValueError, r"\['head.weight'\] are not parameters"),
        ({"0.weight": torch.ones(3)}, ValueError, r"'0.weight'\] must be a tensor of the"),
        ({"0.bias": -torch.ones(3)}, ValueError, "negative or non-finite"),
        ({"0.bias": torch.full((3,), float("nan"))}, ValueError, "negative or non-finite"),
        ([1.0] * 27, TypeError, "flat tensor or a dict"),
    ],
    ids=["short", "not-flat", "unknown-name", "wrong-shape", "negative", "nan", "list"],
)
def test_bad_param_variance(variance, err, pattern):
    net = nn.Sequential(nn.Conv2d(2, 3, 2))
    with pytest.raises(err, match=pattern):
        linearized_variance(net, torch.randn(1, 2, 3, 3), variance)


def test_float32_agrees_with_float64():
    net = tiny_unet(1)
    x = torch.randn(2, 2, 8, 8)
    var = random_variance(net)
    _, v64 = linearized_variance(net, x, var)
    net32 = copy.deepcopy(net).float()
    _, v32 = linearized_variance(net32, x.float(), {n: t.float() for n, t in var.items()})
    assert v32.dtype == torch.float32
    torch.testing.assert_close(v32.double(), v64, rtol=1e-4, atol=1e-7)


def test_unet_model_runs_and_matches_exact_head_contribution():
    net = UNet(1, 2, widths=(2, 4), upsampling="bilinear").eval()
    x = torch.randn(1, 1, 8, 8)
    head = {n: torch.rand_like(p) for n, p in net.named_parameters() if n.startswith("head")}
    _, v = linearized_variance(net, x, head)
    torch.testing.assert_close(v, exact_linearized_variance(net, x, head), **TOL)
    _, v_all = linearized_variance(net, x, flat(net, random_variance(net)))
    assert v_all.shape == (1, 2, 8, 8)
    assert (v_all > 0).all()


def test_diag_backprop_refuses_forward_mode_ad():
    import torch.autograd.forward_ad as fwAD

    from lsn_ext import diag_backprop

    net = nn.Conv2d(1, 1, 1)
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
        with pytest.raises(RuntimeError, match=r"use lsn_ext\.forward\.linearized_variance"):
            diag_backprop(net, x, torch.ones(1, 1, 2, 2), "bce")
