import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

from lsn_ext import BCEWithLogits, CrossEntropy, diag_backprop
from tests.networks import GraphNet, cat, classifier, residual_net, tiny_unet
from tests.reference import dense_db, dense_ggn_diag

TOL = {"rtol": 1e-10, "atol": 1e-12}


def bce_targets(n=2, size=8):
    return (torch.rand(n, 1, size, size) > 0.5).double()


def assert_diagonals_close(got: dict, expected: dict):
    assert list(got) == list(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], **TOL, msg=k)


def eval_mode(net):
    net.eval()
    bn = net.layers["bn"]
    if bn is not None:
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return net


UNETS = {
    f"{up}-{order}": (up, order)
    for up in ("bilinear", "nearest", "transposed")
    for order in ("skip-first", "up-first")
}


@pytest.mark.parametrize("case", UNETS.values(), ids=UNETS.keys())
def test_unet_bce_matches_dense_layerwise_reference(case):
    net = tiny_unet(1, *case)
    x, y = torch.randn(2, 2, 8, 8), bce_targets()
    loss = BCEWithLogits(pos_weight=torch.tensor(3.0))
    res = diag_backprop(net, x, y, loss)
    h = loss.hessian_diag(net(x).detach(), y)
    assert_diagonals_close(res.diagonals, dense_db(net, x, h))
    assert (res.vector >= 0).all()
    torch.testing.assert_close(res.loss, loss.value(net(x), y))


@pytest.mark.parametrize("first_step", ["exact", "diag"])
def test_unet_cross_entropy_matches_dense_reference(first_step):
    net = tiny_unet(3, "bilinear")
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    y[0, :2] = -100
    loss = CrossEntropy(weight=torch.tensor([1.0, 2.0, 0.5]))
    res = diag_backprop(net, x, y, loss, ce_first_step=first_step)
    f = net(x).detach()
    block = loss.hessian_block(f, y) if first_step == "exact" else None
    assert_diagonals_close(res.diagonals, dense_db(net, x, loss.hessian_diag(f, y), block))
    assert (res.vector >= 0).all()


def test_exact_first_step_sees_softmax_invariance_that_diag_start_misses():
    # A head that feeds the same features to every class: the softmax, and so the loss, does
    # not depend on anything below the head. The exact step gives zero curvature there.
    net = tiny_unet(3)
    with torch.no_grad():
        net.layers["head"].weight.copy_(net.layers["head"].weight[:1].expand(3, -1, -1, -1))
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    exact = diag_backprop(net, x, y, "ce").diagonals
    diag = diag_backprop(net, x, y, "ce", ce_first_step="diag").diagonals
    for k in exact:
        if not k.startswith("layers.head"):
            assert exact[k].abs().max() < 1e-12, k
            assert diag[k].min() >= 0, k
            assert diag[k].max() > 1e-4, k
        else:
            torch.testing.assert_close(exact[k], diag[k], **TOL)


def test_residual_and_functional_ops_match_dense_reference():
    net = eval_mode(residual_net())
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 2, (2, 8, 8))
    res = diag_backprop(net, x, y, "ce")
    f = net(x).detach()
    loss = CrossEntropy()
    expected = dense_db(net, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    assert_diagonals_close(res.diagonals, expected)


def test_classifier_nk_logits_matches_dense_reference_and_exact_head():
    net = classifier()
    x, y = torch.randn(5, 2, 6, 6), torch.randint(0, 3, (5,))
    res = diag_backprop(net, x, y, "ce")
    f = net(x).detach()
    loss = CrossEntropy()
    assert_diagonals_close(
        res.diagonals, dense_db(net, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    )
    exact = dense_ggn_diag(net, x, lambda g: F.cross_entropy(g, y, reduction="sum"))
    for k in ("layers.fc.weight", "layers.fc.bias"):
        torch.testing.assert_close(res.diagonals[k], exact[k], **TOL)


def test_mse_regression_matches_dense_reference():
    net = tiny_unet(2)
    x, y = torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    res = diag_backprop(net, x, y, "mse")
    assert_diagonals_close(res.diagonals, dense_db(net, x, torch.ones(2, 2, 8, 8)))
    torch.testing.assert_close(res.loss, 0.5 * (net(x) - y).square().sum())


@pytest.mark.parametrize(
    "make",
    [lambda: nn.Conv2d(2, 3, 3, padding=1), lambda: nn.Sequential(nn.Flatten(), nn.Linear(32, 3))],
    ids=["single-conv", "single-linear"],
)
def test_single_layer_equals_exact_ggn_diagonal(make):
    net = make()
    x = torch.randn(3, 2, 4, 4)
    f = net(x).detach()
    y = (torch.rand_like(f) > 0.5).double()
    res = diag_backprop(net, x, y, "bce")
    exact = dense_ggn_diag(
        net, x, lambda g: F.binary_cross_entropy_with_logits(g, y, reduction="sum")
    )
    assert_diagonals_close(res.diagonals, exact)


def test_db_exact_for_last_layer_and_through_elementwise_tail():
    net = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), bce_targets()
    res = diag_backprop(net, x, y, "bce")
    exact = dense_ggn_diag(
        net, x, lambda g: F.binary_cross_entropy_with_logits(g, y, reduction="sum")
    )
    # The head is exact; d1 is followed only by an elementwise tanh and a 1×1 conv, not exact.
    for k in ("layers.head.weight", "layers.head.bias"):
        torch.testing.assert_close(res.diagonals[k], exact[k], **TOL)
    rel = (res.vector - torch.cat([e.flatten() for e in exact.values()])).norm()
    assert rel > 0  # DB is an approximation below the head

    tail = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Sigmoid())
    res = diag_backprop(tail, x, torch.rand(2, 3, 8, 8), "mse")
    exact = dense_ggn_diag(tail, x, lambda g: 0.5 * (g - 0).square().sum())
    assert_diagonals_close(res.diagonals, exact)


class PlainUNet(nn.Module):
    """A U-Net as users write it: modules, torch.cat in forward, in-place activations."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True))
        self.enc2 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.LeakyReLU(0.1, inplace=True))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.dec = nn.Conv2d(7, 3, 3, padding=1)
        self.act = nn.ELU(inplace=True)
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        s = self.enc1(x)
        b = self.enc2(self.pool(s))
        u = torch.cat([self.up(b), s], dim=1)
        return self.head(self.act(self.dec(u)))

    def graph(self) -> GraphNet:
        layers = {
            "c1": self.enc1[0], "r1": nn.ReLU(), "p": self.pool, "c2": self.enc2[0],
            "r2": nn.LeakyReLU(0.1), "up": self.up, "dec": self.dec, "act": nn.ELU(),
            "head": self.head,
        }  # fmt: skip
        nodes = [
            ("a", "c1", ("x",)), ("s", "r1", ("a",)), ("q", "p", ("s",)), ("b1", "c2", ("q",)),
            ("b", "r2", ("b1",)), ("ub", "up", ("b",)), ("u", cat, ("ub", "s")),
            ("d", "dec", ("u",)), ("e", "act", ("d",)), ("out", "head", ("e",)),
        ]  # fmt: skip
        return GraphNet(layers, nodes, "out")


def test_plain_unet_with_inplace_activations_matches_reference():
    net = PlainUNet()
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 2, (2, 8, 8))
    res = diag_backprop(net, x, y, "ce")
    graph = net.graph()
    f = net(x).detach()
    torch.testing.assert_close(graph(x), f, rtol=0, atol=0)
    loss = CrossEntropy()
    expected = dense_db(graph, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    names = dict(zip(expected, res.diagonals, strict=True))
    for k_graph, k_net in names.items():
        torch.testing.assert_close(res.diagonals[k_net], expected[k_graph], **TOL, msg=k_net)
    torch.testing.assert_close(res.logits, f, rtol=0, atol=0)


def test_module_called_twice_sums_both_uses():
    shared = nn.Conv2d(2, 2, 3, padding=1)
    net = GraphNet(
        {"c": shared, "a": nn.Tanh(), "head": nn.Conv2d(4, 1, 1)},
        [
            ("h", "c", ("x",)),
            ("t", "a", ("h",)),
            ("h2", "c", ("t",)),
            ("k", cat, ("t", "h2")),
            ("out", "head", ("k",)),
        ],
        "out",
    )
    x, y = torch.randn(2, 2, 6, 6), bce_targets(2, 6)
    res = diag_backprop(net, x, y, "bce")
    h = BCEWithLogits().hessian_diag(net(x).detach(), y)
    assert_diagonals_close(res.diagonals, dense_db(net, x, h))


def test_frozen_parameters_are_skipped_and_others_unchanged():
    net = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), bce_targets()
    full = diag_backprop(net, x, y, "bce").diagonals
    net.layers["e1"].weight.requires_grad_(False)
    part = diag_backprop(net, x, y, "bce").diagonals
    assert "layers.e1.weight" not in part
    for k, v in part.items():
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)
    chosen = [net.layers["head"].weight]
    only = diag_backprop(net, x, y, "bce", params=chosen).diagonals
    assert list(only) == ["layers.head.weight"]


def test_reduction_mean_scales_by_count():
    net = tiny_unet(3)
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    total = diag_backprop(net, x, y, nn.CrossEntropyLoss(reduction="sum")).vector
    mean = diag_backprop(net, x, y, nn.CrossEntropyLoss()).vector
    torch.testing.assert_close(mean * y.numel(), total, **TOL)


def test_float32_agrees_with_float64():
    net = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), bce_targets()
    d64 = diag_backprop(net, x, y, "bce").vector
    net32 = copy.deepcopy(net).float()
    d32 = diag_backprop(net32, x.float(), y.float(), "bce").vector
    assert d32.dtype == torch.float32
    torch.testing.assert_close(d32.double(), d64, rtol=1e-4, atol=1e-6)


def snapshot(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(id(m), dict(m.__dict__)) for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
        [m.training for m in model.modules()],
        [p.grad for p in model.parameters()],
    )


def assert_unchanged(model: nn.Module, before):
    state, dicts, flags, modes, grads = before
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    for (mid, d), m in zip(dicts, model.modules(), strict=True):
        assert mid == id(m)
        assert set(m.__dict__) == set(d), type(m).__name__
        for key in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            assert len(m.__dict__[key]) == len(d[key]), (type(m).__name__, key)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())
    assert all(g is None for g in grads)


def test_model_left_as_found_and_usable_with_torch_func():
    net = PlainUNet()
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 2, (2, 8, 8))
    before = snapshot(net)
    diag_backprop(net, x, y, "ce")
    assert_unchanged(net, before)
    params = {k: v.detach() for k, v in net.named_parameters()}
    jac = jacrev(lambda p: functional_call(net, p, (x[:1],)))(params)
    assert jac["head.bias"].shape == (1, 2, 8, 8, 2)


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 1)
        self.inner = nn.Sequential(nn.Identity())

    def forward(self, x):
        return self.inner(torch.exp(self.conv(x)))


def test_model_left_as_found_after_failing_call():
    net = ExpNet()
    before = snapshot(net)
    with pytest.raises(NotImplementedError, match="'exp' in the forward of '<model>' \\(ExpNet\\)"):
        diag_backprop(net, torch.randn(1, 2, 4, 4), torch.ones(1, 1, 4, 4), "bce")
    assert_unchanged(net, before)
    torch.testing.assert_close(
        net(torch.zeros(1, 2, 1, 1)), torch.exp(net.conv.bias).reshape(1, 1, 1, 1)
    )


class InplaceGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 1, 1), nn.Conv2d(2, 1, 1)

    def forward(self, x):
        return self.a(x).mul_(self.b(x))


class Erf(nn.Module):
    def forward(self, x):
        return torch.erf(x)


class MyConv(nn.Conv2d):
    pass


class ScaledConv(nn.Conv2d):
    def forward(self, x):
        return 2 * super().forward(x)


ERRORS = {
    "rmsnorm-module": (
        lambda: nn.Sequential(nn.Conv2d(2, 1, 1), nn.RMSNorm([1, 4, 4])),
        NotImplementedError,
        r"no rule for torch.nn.RMSNorm at '1'.*"
        r"Supported modules: torch.nn.Linear, torch.nn.Conv1d",
    ),
    "subclass-hint": (
        lambda: nn.Sequential(MyConv(2, 1, 1)),
        NotImplementedError,
        r"subclasses torch.nn.Conv2d without changing forward.*"
        r"register_rule\(MyConv, lsn_ext.rules.ConvRule\(\)\)",
    ),
    "subclass-with-own-forward": (
        lambda: nn.Sequential(ScaledConv(2, 1, 1)),
        NotImplementedError,
        r"subclasses torch.nn.Conv2d but overrides forward, so that rule does not apply",
    ),
    "in-place-product-of-branches": (
        InplaceGate,
        NotImplementedError,
        r"'mul_'.*'<model>' \(InplaceGate\).*Write y = a \* b",
    ),
    "custom-activation": (
        lambda: nn.Sequential(nn.Conv2d(2, 1, 1), Erf()),
        NotImplementedError,
        r"'erf' in the forward of '1' \(Erf\)",
    ),
    "dropout-train": (
        lambda: nn.Sequential(nn.Conv2d(2, 1, 1), nn.Dropout(0.3)).train(),
        ValueError,
        r"'1' \(Dropout\).*training mode.*model.eval\(\)",
    ),
    "batchnorm-train": (
        lambda: nn.Sequential(nn.Conv2d(2, 1, 1), nn.BatchNorm2d(1)).train(),
        ValueError,
        r"'1' \(BatchNorm2d\).*batch statistics.*model.eval\(\)",
    ),
    "instancenorm-train-running-stats": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 1, 1), nn.InstanceNorm2d(1, track_running_stats=True)
        ).train(),
        ValueError,
        r"'1' \(InstanceNorm2d\).*track_running_stats=True and is in training mode.*"
        r"model.eval\(\)",
    ),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_unsupported_models_raise_clear_errors(case):
    make, err, pattern = case
    net = make()
    before = snapshot(net)
    with pytest.raises(err, match=pattern):
        diag_backprop(net, torch.randn(2, 2, 4, 4), torch.ones(2, 1, 4, 4), "bce")
    assert_unchanged(net, before)


@pytest.mark.parametrize(
    ("mode", "origin"),
    [("nearest", "UpsampleNearest2DBackward0"), ("bilinear", r"'1' \(Upsample\)")],
    ids=["after-autograd-op", "after-rule-without-block"],
)
def test_exact_ce_needs_head_as_last_operation(mode, origin):
    net = nn.Sequential(nn.Conv2d(2, 3, 1), nn.Upsample(scale_factor=2, mode=mode))
    x, y = torch.randn(1, 2, 4, 4), torch.randint(0, 3, (1, 8, 8))
    with pytest.raises(ValueError, match=rf"output of a Linear.*{origin}.*'diag'"):
        diag_backprop(net, x, y, "ce")
    assert diag_backprop(net, x, y, "ce", ce_first_step="diag").vector.min() >= 0


@pytest.mark.parametrize(
    ("kwargs", "err", "pattern"),
    [
        ({"loss": "hinge"}, ValueError, "unknown loss 'hinge'"),
        ({"loss": nn.CrossEntropyLoss(reduction="none")}, ValueError, "reduction='none'"),
        ({"ce_first_step": "full"}, ValueError, "ce_first_step"),
        ({"targets": torch.randint(0, 2, (1, 3, 3))}, ValueError, r"targets must be class"),
        ({"targets": torch.full((1, 4, 4), 7)}, ValueError, r"target 7 is outside \[0, 2\)"),
        ({"params": [nn.Parameter(torch.ones(1))]}, ValueError, "not parameters of the model"),
    ],
    ids=["unknown-loss", "reduction-none", "bad-first-step", "bad-shape", "bad-class", "foreign"],
)
def test_bad_arguments(kwargs, err, pattern):
    net = nn.Conv2d(2, 2, 1)
    args = {"loss": "ce", "targets": torch.randint(0, 2, (1, 4, 4)), **kwargs}
    with pytest.raises(err, match=pattern):
        diag_backprop(net, torch.randn(1, 2, 4, 4), **args)


def test_tuple_output_is_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(2, 1, 1)

        def forward(self, x):
            return self.c(x), x

    with pytest.raises(TypeError, match=r"returned a tuple of 2 outputs.*wrap the model"):
        diag_backprop(Two(), torch.randn(1, 2, 4, 4), torch.ones(1, 1, 4, 4), "bce")


def flip(a):
    return a.flip(-1)


# Each entry is the middle of conv -> ... -> 1×1 head: (name, function, inputs) nodes. Every node
# is one layer for the dense reference, so each holds a single operation.
FUNCTIONAL = {
    "sigmoid": [("g", torch.sigmoid, ("h",))],
    "tensor-tanh": [("g", lambda a: a.tanh(), ("h",))],
    "leaky-relu": [("g", lambda a: F.leaky_relu(a, 0.3), ("h",))],
    "elu": [("g", lambda a: F.elu(a, alpha=0.5), ("h",))],
    "gelu-tanh": [("g", lambda a: F.gelu(a, approximate="tanh"), ("h",))],
    "softplus": [("g", lambda a: F.softplus(a, beta=2.0), ("h",))],
    "rsub": [("g", lambda a: 1.0 - a, ("h",))],
    "sub-branches": [("r", flip, ("h",)), ("g", lambda a, b: a - b, ("r", "h"))],
    "add-alpha": [
        ("r", flip, ("h",)),
        ("g", lambda a, b: torch.add(a, b, alpha=-2.0), ("h", "r")),
    ],
    "mul-constant-tensor": [("g", lambda a: a * torch.linspace(-1, 2, a.shape[-1]), ("h",))],
    "div-constant": [("g", lambda a: a / 4.0, ("h",))],
    "neg": [("g", lambda a: -a, ("h",))],
    "mean-keepdim": [
        ("m", lambda a: a.mean(dim=1, keepdim=True), ("h",)),
        ("g", torch.add, ("h", "m")),
    ],
    "adaptive-avg-global": [
        ("p", lambda a: F.adaptive_avg_pool2d(a, 1), ("h",)),
        ("g", torch.add, ("h", "p")),
    ],
    "avg-pool-ceil": [
        ("p", lambda a: F.avg_pool2d(a, 3, stride=2, padding=1, ceil_mode=True), ("h",)),
        ("g", lambda a: F.interpolate(a, size=(6, 6)), ("p",)),
    ],
    "interpolate-area-bicubic": [
        ("p", lambda a: F.interpolate(a, scale_factor=0.5, mode="area"), ("h",)),
        ("g", lambda a: F.interpolate(a, scale_factor=2, mode="bicubic"), ("p",)),
    ],
    "dropout-eval": [("g", lambda a: F.dropout(a, 0.5, training=False), ("h",))],
    "crop-and-pad": [
        ("p", lambda a: a[..., 1:-1, 1:-1], ("h",)),
        ("g", lambda a: F.pad(a, (1, 1, 1, 1), mode="replicate"), ("p",)),
    ],
}


@pytest.mark.parametrize("middle", FUNCTIONAL.values(), ids=FUNCTIONAL.keys())
def test_functional_operations_match_dense_reference(middle):
    net = GraphNet(
        {"c": nn.Conv2d(2, 3, 3, padding=1), "head": nn.Conv2d(3, 2, 1)},
        [("h", "c", ("x",)), *middle, ("out", "head", ("g",))],
        "out",
    )
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 2, (2, 6, 6))
    res = diag_backprop(net, x, y, "ce")
    f = net(x).detach()
    loss = CrossEntropy()
    expected = dense_db(net, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    assert_diagonals_close(res.diagonals, expected)


REFUSED = {
    "exp": (lambda a: torch.exp(a), "'exp'"),
    "matmul": (lambda a: a @ a.transpose(-1, -2), "'matmul'"),
    "pow": (lambda a: a**2, "'pow'"),
    "divide-by-branch": (lambda a: a / a.flip(-1), "divisor depends"),
    "inplace-scale": (lambda a: a.clone().mul_(2.0), "Write x = x \\* c"),
    "dropout-train": (lambda a: F.dropout(a, 0.5, training=True), "random Jacobian"),
    "softmax": (lambda a: torch.softmax(a, 1), "'softmax'"),
    "antialias": (
        lambda a: F.interpolate(a, scale_factor=0.5, mode="bilinear", antialias=True),
        "antialias",
    ),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_unsupported_functional_operations_are_refused(case):
    fn, pattern = case
    net = GraphNet(
        {"c": nn.Conv2d(2, 3, 3, padding=1), "head": nn.Conv2d(3, 1, 1)},
        [("h", "c", ("x",)), ("g", fn, ("h",)), ("out", "head", ("g",))],
        "out",
    )
    with pytest.raises(NotImplementedError, match=pattern) as info:
        diag_backprop(net, torch.randn(1, 2, 4, 4), torch.ones(1, 1, 4, 4), "bce")
    assert "in the forward of '<model>' (GraphNet)" in str(info.value)
    assert "lsn_ext.register_rule" in str(info.value)


def test_inplace_change_of_a_needed_output_is_reported_clearly():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.t, self.head = nn.Conv2d(2, 2, 1), nn.Tanh(), nn.Conv2d(2, 1, 1)

        def forward(self, x):
            h = self.t(self.c(x))
            h += 1.0
            return self.head(h)

    with pytest.raises(RuntimeError, match="in-place operation in forward modified"):
        diag_backprop(Net(), torch.randn(1, 2, 4, 4), torch.ones(1, 1, 4, 4), "bce")


# -- normalisation layers (MONAI, nnU-Net) --------------------------------------------------------

# conv → norm → activation → conv; each entry builds (norm, activation).
NORM_NETS = {
    "instancenorm-affine-leakyrelu": lambda: (nn.InstanceNorm2d(4, affine=True), nn.LeakyReLU()),
    # InstanceNorm's output is a view, then changed in place (MONAI, nnU-Net).
    "instancenorm-affine-leakyrelu-inplace": lambda: (
        nn.InstanceNorm2d(4, affine=True),
        nn.LeakyReLU(0.1, inplace=True),
    ),
    # A negative slope: the rule reads (a copy of) the input instead of the output.
    "instancenorm-affine-leakyrelu-negative-slope-inplace": lambda: (
        nn.InstanceNorm2d(4, affine=True),
        nn.LeakyReLU(-0.2, inplace=True),
    ),
    "instancenorm-running-stats-tanh": lambda: (
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.Tanh(),
    ),
    "groupnorm-prelu": lambda: (nn.GroupNorm(2, 4), nn.PReLU(4)),
    "groupnorm-1-group-prelu-1": lambda: (nn.GroupNorm(1, 4), nn.PReLU()),
    "layernorm-chw-prelu": lambda: (nn.LayerNorm([4, 6, 6]), nn.PReLU(4)),
    # MONAI's Act["SOFTMAX"] / Act["LOGSOFTMAX"] as hidden activations (over the channels)
    "instancenorm-affine-softmax": lambda: (nn.InstanceNorm2d(4, affine=True), nn.Softmax(1)),
    "groupnorm-log-softmax": lambda: (nn.GroupNorm(2, 4), nn.LogSoftmax(1)),
}


def randomise_norm_and_act(*modules: nn.Module) -> None:
    """Random affine parameters, running statistics and slopes (defaults 1, 0 hide mistakes)."""
    with torch.no_grad():
        for m in modules:
            for name, p in m.named_parameters():
                if name == "weight":
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0, 0.3)
            if getattr(m, "running_mean", None) is not None:
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)


def norm_net(make) -> tuple[nn.Sequential, GraphNet]:
    """The model (as users write it) and its dense-reference twin sharing every parameter.

    The twin's activation is a copy working out of place (the references evaluate it on
    tensors they keep).
    """
    norm, act = make()
    randomise_norm_and_act(norm, act)
    c1, c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)
    net = nn.Sequential(c1, norm, act, c2).eval()
    act_ref = copy.copy(act)
    if getattr(act, "inplace", False):
        act_ref.inplace = False
    nodes = [("h", "c1", ("x",)), ("n", "norm", ("h",)), ("a", "act", ("n",))]
    nodes.append(("out", "c2", ("a",)))
    graph = GraphNet({"c1": c1, "norm": norm, "act": act_ref, "c2": c2}, nodes, "out")
    return net, graph


@pytest.mark.parametrize("make", NORM_NETS.values(), ids=NORM_NETS.keys())
def test_norm_networks_match_dense_layerwise_reference(make):
    net, graph = norm_net(make)
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 3, (2, 6, 6))
    f = graph(x).detach()
    res = diag_backprop(net, x, y, "ce")
    torch.testing.assert_close(res.logits, f, rtol=0, atol=0)
    loss = CrossEntropy()
    expected = dense_db(graph, x, loss.hessian_diag(f, y), loss.hessian_block(f, y))
    for k_graph, k_net in zip(expected, res.diagonals, strict=True):
        assert expected[k_graph].abs().max() > 0, k_graph
        torch.testing.assert_close(res.diagonals[k_net], expected[k_graph], **TOL, msg=k_net)


SINGLE_NORMS = {
    "instancenorm-affine": lambda: nn.InstanceNorm2d(3, affine=True),
    "groupnorm": lambda: nn.GroupNorm(3, 3),
    "layernorm-chw": lambda: nn.LayerNorm([3, 5, 5]),
}


@pytest.mark.parametrize("make", SINGLE_NORMS.values(), ids=SINGLE_NORMS.keys())
def test_db_exact_for_a_last_norm_layer_and_approximate_below(make):
    # conv → norm → PReLU → tanh, BCE: the norm's parameters are followed only by elementwise
    # maps, so DB is exact for them (and for PReLU's slopes); the norm's Jacobian couples the
    # entries of each group, so the conv below is approximate.
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), make(), nn.PReLU(3), nn.Tanh())
    randomise_norm_and_act(net[1], net[2])
    x = torch.randn(2, 2, 5, 5)
    f = net(x).detach()
    y = (torch.rand_like(f) > 0.5).double()
    res = diag_backprop(net, x, y, "bce")
    exact = dense_ggn_diag(
        net, x, lambda g: F.binary_cross_entropy_with_logits(g, y, reduction="sum")
    )
    for k in ("1.weight", "1.bias", "2.weight"):
        torch.testing.assert_close(res.diagonals[k], exact[k], **TOL, msg=k)
    assert not torch.allclose(res.diagonals["0.weight"], exact["0.weight"], rtol=1e-3)


class _TwoHeads(nn.Module):
    """Logits as the sum of two convolution heads on disjoint channel halves."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)
        self.head_a, self.head_b = nn.Conv2d(2, 3, 1), nn.Conv2d(2, 3, 1)

    def forward(self, x):
        t = torch.tanh(self.c(x))
        return self.head_a(t[:, :2]) + self.head_b(t[:, 2:])


def test_exact_ce_first_step_through_summed_heads_equals_one_concatenated_head():
    """``A t₁ + B t₂`` is one head ``[A, B]`` on ``t``: the block reaches each half exactly."""
    two = _TwoHeads()
    one = nn.Sequential(two.c, nn.Tanh(), nn.Conv2d(4, 3, 1))
    with torch.no_grad():
        one[2].weight.copy_(torch.cat([two.head_a.weight, two.head_b.weight], 1))
        one[2].bias.copy_(two.head_a.bias + two.head_b.bias)
    x, y = torch.randn(2, 2, 5, 5), torch.randint(0, 3, (2, 5, 5))
    got = diag_backprop(two, x, y, "ce").diagonals
    want = diag_backprop(one, x, y, "ce").diagonals
    for k in ("weight", "bias"):
        torch.testing.assert_close(got[f"c.{k}"], want[f"0.{k}"], rtol=1e-12, atol=0)
    torch.testing.assert_close(got["head_a.weight"], want["2.weight"][:, :2], rtol=1e-12, atol=0)
    torch.testing.assert_close(got["head_b.weight"], want["2.weight"][:, 2:], rtol=1e-12, atol=0)
    torch.testing.assert_close(got["head_a.bias"], want["2.bias"], rtol=1e-12, atol=0)
    diag_start = diag_backprop(two, x, y, "ce", ce_first_step="diag").diagonals
    assert not torch.allclose(diag_start["c.weight"], got["c.weight"])


def test_exact_ce_first_step_refuses_a_sum_with_a_non_head_branch():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.head = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)

        def forward(self, x):
            t = torch.tanh(self.c(x))
            return self.head(t) + t

    x, y = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))
    with pytest.raises(ValueError, match=r"or a sum of such outputs.*a functional tanh"):
        diag_backprop(Residual(), x, y, "ce")


class _FunctionalActs(nn.Module):
    """Convolutions joined by functional activations, in place or not."""

    def __init__(self, act: str, inplace: bool):
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 2, 1)
        self.act, self.inplace = act, inplace

    def forward(self, x):
        h = self.c1(x)
        out = getattr(nn.functional, self.act)(h, inplace=self.inplace)
        return self.c2(h if self.inplace else out)


@pytest.mark.parametrize(
    "act", ["silu", "mish", "hardswish", "hardsigmoid", "selu", "celu", "elu", "leaky_relu"]
)
def test_in_place_functional_activations_give_the_out_of_place_diagonal(act):
    x, y = torch.randn(2, 1, 5, 5), torch.randint(0, 2, (2, 5, 5))
    net = _FunctionalActs(act, inplace=False)
    ref = diag_backprop(net, x, y, "ce")
    net.inplace = True
    got = diag_backprop(net, x, y, "ce")
    for name, d in ref.diagonals.items():
        torch.testing.assert_close(got.diagonals[name], d, rtol=1e-12, atol=0)
    assert any(float(d.sum()) > 0 for d in ref.diagonals.values())


class _Unpooled(nn.Module):
    """``max_unpool2d(max_pool2d(h))`` (Quicknat) or the same as a constant 0/1 mask."""

    def __init__(self, unpool: bool):
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 2, 1)
        self.unpool = unpool

    def forward(self, x):
        h = torch.as_tensor(torch.tanh(self.c1(x)))  # as in MONAI's HighResNet
        if self.unpool:
            pooled, idx = nn.functional.max_pool2d(h, 2, return_indices=True)
            h = nn.functional.max_unpool2d(pooled, idx, 2, output_size=h.shape[-2:])
        else:
            with torch.no_grad():
                _, idx = nn.functional.max_pool2d(h, 2, return_indices=True)
                mask = torch.zeros_like(h).flatten(2).scatter_(2, idx.flatten(2), 1.0)
            h = h * mask.view_as(h)
        return self.c2(h)


def test_max_unpool_and_as_tensor_are_structural():
    x, y = torch.randn(2, 1, 6, 6), torch.randint(0, 2, (2, 6, 6))
    net = _Unpooled(unpool=True)
    ref = _Unpooled(unpool=False)
    ref.load_state_dict(net.state_dict())
    got, want = diag_backprop(net, x, y, "ce"), diag_backprop(ref, x, y, "ce")
    for name, d in want.diagonals.items():
        torch.testing.assert_close(got.diagonals[name], d, rtol=1e-12, atol=1e-15)
    assert float(got.diagonals["c1.weight"].sum()) > 0
