"""The BackPACK adapter agrees with the native engine, refuses clearly, and leaves models alone."""

import copy

import pytest
import torch
from backpack import backpack, extend
from backpack.custom_module.branching import SumModule
from backpack.custom_module.scale_module import ScaleModule
from backpack.extensions import DiagGGNExact
from torch import nn
from torch.func import functional_call, grad

import lsn_ext
from lsn_ext.backpack_ext import Cat, DiagBackpropExtension, convert, diagonals
from lsn_ext.models import UNet
from lsn_ext.rules import RULES, TanhRule

# BackPACK's hooks on the first layer, whose input needs no gradient, make torch warn.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TOL = {"rtol": 1e-10, "atol": 1e-14}


def run_backpack(net: nn.Module, x, y, loss: nn.Module, **options) -> dict:
    lossfunc = extend(copy.deepcopy(loss))
    with backpack(DiagBackpropExtension(**options)):
        lossfunc(net(x), y).backward()
    return diagonals(net)


def assert_matches_engine(got: dict, model: nn.Module, x, y, loss, **options):
    expected = lsn_ext.diag_backprop(model, x, y, loss, **options).diagonals
    assert set(got) == set(expected)
    for name, diag in expected.items():
        assert diag.abs().max() > 0, name
        torch.testing.assert_close(got[name], diag, **TOL, msg=name)


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
    )


# -- agreement with the native engine -----------------------------------------------------------


@pytest.mark.parametrize("route", ["extend", "convert"])
@pytest.mark.parametrize("first_step", ["exact", "diag"])
def test_sequential_cnn_cross_entropy(route, first_step):
    net = cnn()
    x, y = torch.randn(3, 2, 8, 8), torch.randint(0, 5, (3,))
    bp_net = extend(copy.deepcopy(net)) if route == "extend" else convert(net)
    loss = nn.CrossEntropyLoss()
    got = run_backpack(bp_net, x, y, loss, ce_first_step=first_step)
    assert_matches_engine(got, net, x, y, loss, ce_first_step=first_step)


def _ce_targets(n=2, classes=3, size=8):
    y = torch.randint(0, classes, (n, size, size))
    y[0, :2] = -1  # ignored positions
    return y


LOSSES = {
    "bce-pos-weight": (
        1,
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0]), reduction="sum"),
        lambda: (torch.rand(2, 1, 8, 8) > 0.5).double(),
        {},
    ),
    "ce-exact-weights-ignore": (
        3,
        lambda: nn.CrossEntropyLoss(torch.tensor([1.0, 2.0, 0.5]), ignore_index=-1),
        _ce_targets,
        {"ce_first_step": "exact"},
    ),
    "ce-diag-weights-ignore": (
        3,
        lambda: nn.CrossEntropyLoss(
            torch.tensor([1.0, 2.0, 0.5]), ignore_index=-1, reduction="sum"
        ),
        _ce_targets,
        {"ce_first_step": "diag"},
    ),
    "mse-mean": (2, lambda: nn.MSELoss(), lambda: torch.randn(2, 2, 8, 8), {}),
}


@pytest.mark.parametrize("upsampling", ["nearest", "bilinear"])
@pytest.mark.parametrize("case", LOSSES.values(), ids=LOSSES.keys())
def test_unet_with_cat_skips_through_convert(upsampling, case):
    out_channels, make_loss, make_targets, options = case
    net = UNet(2, out_channels, widths=(2, 3, 4), upsampling=upsampling)
    x, y, loss = torch.randn(2, 2, 8, 8), make_targets(), make_loss()
    converted = convert(net, x)
    assert sum(isinstance(m, Cat) for m in converted.modules()) == 2
    got = run_backpack(converted, x, y, loss, **options)
    assert_matches_engine(got, net, x, y, loss, **options)


def test_unet_transposed_16x16_and_a_second_backward_pass():
    net = UNet(1, 2, widths=(2, 3, 4), upsampling="transposed")
    x, y = torch.randn(2, 1, 16, 16), torch.randint(0, 2, (2, 16, 16))
    converted = convert(net, x)
    loss = nn.CrossEntropyLoss(reduction="sum")
    run_backpack(converted, x, y, loss)
    got = run_backpack(converted, x, y, loss)  # results are replaced, not accumulated
    assert_matches_engine(got, net, x, y, loss)


class Residual(nn.Module):
    """Additive residual, a difference, scalings and a batch norm; flatten with a keyword."""

    def __init__(self):
        super().__init__()
        self.c1, self.a1 = nn.Conv2d(2, 3, 3, padding=1), nn.Tanh()
        self.c2, self.bn, self.a2 = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.SiLU()
        self.c3, self.pool = nn.Conv2d(3, 3, 3, padding=1), nn.AvgPool2d(2)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        h = self.a1(self.c1(x))
        r = h + self.a2(self.bn(self.c2(h)))
        d = -(0.5 * r - self.c3(r) / 3) + 2 * h
        return self.fc(torch.flatten(self.pool(d), start_dim=1))


def residual_eval() -> Residual:
    net = Residual().eval()
    bn = net.bn
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return net


@pytest.mark.parametrize("first_step", ["exact", "diag"])
def test_residual_sum_scale_and_batchnorm_eval(first_step):
    net = residual_eval()
    x, y = torch.randn(3, 2, 8, 8), torch.randint(0, 4, (3,))
    converted = convert(net)
    types = [type(m) for m in converted.modules()]
    assert types.count(SumModule) == 3
    assert ScaleModule in types
    loss = nn.CrossEntropyLoss()
    got = run_backpack(converted, x, y, loss, ce_first_step=first_step)
    assert_matches_engine(got, net, x, y, loss, ce_first_step=first_step)


# conv → norm → activation → conv, through BackPACK (lookup by exact class in RULES).
NORM_NETS = {
    "instancenorm-affine-leakyrelu": lambda: (nn.InstanceNorm2d(4, affine=True), nn.LeakyReLU()),
    "instancenorm-running-stats-tanh": lambda: (
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.Tanh(),
    ),
    "groupnorm-prelu": lambda: (nn.GroupNorm(2, 4), nn.PReLU(4)),
    "layernorm-chw-prelu": lambda: (nn.LayerNorm([4, 6, 6]), nn.PReLU()),
    "instancenorm-affine-softmax": lambda: (nn.InstanceNorm2d(4, affine=True), nn.Softmax(1)),
    "groupnorm-log-softmax": lambda: (nn.GroupNorm(2, 4), nn.LogSoftmax(1)),
}


@pytest.mark.parametrize("route", ["extend", "convert"])
@pytest.mark.parametrize("make", NORM_NETS.values(), ids=NORM_NETS.keys())
def test_norm_layers_and_prelu(make, route):
    norm, act = make()
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), norm, act, nn.Conv2d(4, 3, 1)).eval()
    with torch.no_grad():
        for m in (norm, act):
            for p in m.parameters():
                p.uniform_(0.5, 1.5)
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 3, (2, 6, 6))
    bp_net = extend(copy.deepcopy(net)) if route == "extend" else convert(net, x)
    loss = nn.CrossEntropyLoss()
    got = run_backpack(bp_net, x, y, loss)
    assert_matches_engine(got, net, x, y, loss)


class CatModel(nn.Module):
    """The model-side route: Cat modules instead of torch.cat, BackPACK's converter directly."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(2, 2, 1)
        self.act, self.cat = nn.Sigmoid(), Cat(dim=1)
        self.head = nn.Conv2d(5, 3, 1)

    def forward(self, x):
        return self.head(self.cat(self.act(self.a(x)), self.b(x) * 0.5))


def test_cat_module_with_backpack_converter():
    net = CatModel()
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 3, (2, 6, 6))
    extended = extend(copy.deepcopy(net), use_converter=True)
    loss = nn.CrossEntropyLoss()
    got = run_backpack(extended, x, y, loss)
    assert_matches_engine(got, net, x, y, loss)


def test_coexists_with_backpack_diag_ggn_and_is_exact_for_the_last_layer():
    """Rules that evaluate their module must not re-run BackPACK's hooks (max pool, flatten)."""
    net = extend(cnn())
    x, y = torch.randn(3, 2, 8, 8), torch.randn(3, 5)
    loss = extend(nn.MSELoss(reduction="sum"))
    with backpack(DiagGGNExact(), DiagBackpropExtension()):
        loss(net(x), y).backward()
    got = diagonals(net)
    for p in net[-1].parameters():
        torch.testing.assert_close(p.diag_backprop, p.diag_ggn_exact, **TOL)
    assert_matches_engine(got, net, x, y, nn.MSELoss(reduction="sum"))


class MyTanh(nn.Tanh):
    pass


def test_rule_registered_after_construction_reaches_backpack():
    net = nn.Sequential(nn.Linear(4, 3), MyTanh(), nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    extension = DiagBackpropExtension()
    lsn_ext.register_rule(MyTanh, TanhRule())
    try:
        bp_net = extend(copy.deepcopy(net))
        lossfunc = extend(nn.CrossEntropyLoss())
        with backpack(extension):
            lossfunc(bp_net(x), y).backward()
        assert_matches_engine(diagonals(bp_net), net, x, y, nn.CrossEntropyLoss())
        with pytest.raises(NotImplementedError, match=r"MyTanh.*torch\.nn"):
            convert(net)
    finally:
        del RULES[MyTanh]


# -- the user's model is left alone ---------------------------------------------------------------


def test_original_model_unchanged_and_usable_with_torch_func():
    net = UNet(2, 1, widths=(2, 3), upsampling="bilinear")
    x, y = torch.randn(2, 2, 4, 4), (torch.rand(2, 1, 4, 4) > 0.5).double()
    state = copy.deepcopy(net.state_dict())
    names = [n for n, _ in net.named_modules()]
    before = net(x)
    converted = convert(net, x)
    run_backpack(converted, x, y, nn.BCEWithLogitsLoss())
    assert [n for n, _ in net.named_modules()] == names
    assert all(not m._forward_hooks and not m._backward_hooks for m in net.modules())
    assert all(not hasattr(p, "diag_backprop") for p in net.parameters())
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), k
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)
    torch.testing.assert_close(converted(x), before, **TOL)
    params = {k: v.detach() for k, v in net.named_parameters()}
    grads = grad(lambda p: functional_call(net, p, (x,)).square().sum())(params)
    assert grads["head.weight"].shape == (1, 2, 1, 1)
    assert all(g.abs().sum() > 0 for g in grads.values())


# -- errors -------------------------------------------------------------------------------------


def test_unsupported_module_raises_at_convert_with_its_path():
    net = nn.Sequential(nn.Linear(4, 3), nn.RMSNorm(3), nn.Linear(3, 2))
    with pytest.raises(NotImplementedError, match=r"RMSNorm at '1'.*register_rule"):
        convert(net)


def test_unsupported_module_raises_in_backward():
    net = extend(nn.Sequential(nn.Linear(4, 3), nn.RMSNorm(3), nn.Linear(3, 2)))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(NotImplementedError, match=r"RMSNorm.*Supported modules: torch.nn.Linear"):
        run_backpack(net, x, y, nn.CrossEntropyLoss())


def test_cross_entropy_exact_needs_a_linear_head():
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2), nn.Tanh())
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match=r"direct output of a Linear.*come from Tanh"):
        run_backpack(extend(copy.deepcopy(net)), x, y, nn.CrossEntropyLoss())
    got = run_backpack(
        extend(copy.deepcopy(net)), x, y, nn.CrossEntropyLoss(), ce_first_step="diag"
    )
    assert_matches_engine(got, net, x, y, nn.CrossEntropyLoss(), ce_first_step="diag")


def test_functional_operations_are_refused_by_convert():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x)).reshape(x.shape[0], 2, 2)

    with pytest.raises(NotImplementedError, match=r"tanh.*Tensor\.reshape.*nn\.Tanh"):
        convert(Functional(), torch.randn(3, 4))


def test_shape_checks_in_forward_need_an_example_input():
    class Checked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            if x.dim() != 2:
                raise ValueError(f"expected [N, 3], got {tuple(x.shape)}")
            return self.lin(x)

    with pytest.raises(ValueError, match="pass example_input"):
        convert(Checked())


def test_the_packaged_unet_converts_without_an_example_input():
    """Its input checks are skipped for a symbolic input (torch.fx), so tracing needs no example."""
    net = UNet(1, 1, widths=(2, 3)).eval()
    converted = convert(net)
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(converted(x), net(x))


def test_shared_module_with_parameters_is_refused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(self.lin(x))

    with pytest.raises(NotImplementedError, match=r"'lin' \(Linear\).*called 2 times"):
        convert(Shared())


def test_training_mode_dropout_and_scaled_loss_raise():
    net = extend(nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.Linear(3, 2)))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match="training mode"):
        run_backpack(net, x, y, nn.CrossEntropyLoss())
    net.eval()
    lossfunc = extend(nn.CrossEntropyLoss())
    with (
        pytest.raises(ValueError, match="backward\\(\\) on the loss itself"),
        backpack(DiagBackpropExtension()),
    ):
        (2 * lossfunc(net(x), y)).backward()


def test_model_without_converter_that_uses_functions_raises():
    net = extend(CatModel())  # no converter: torch.cat and * are invisible to BackPACK
    x, y = torch.randn(2, 2, 6, 6), torch.randint(0, 3, (2, 6, 6))
    with pytest.raises(NotImplementedError, match=r"cannot handle CatModel\(\)\..*convert\(model"):
        run_backpack(net, x, y, nn.CrossEntropyLoss())


def test_loss_not_extended_raises():
    net = extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with (
        pytest.raises(NotImplementedError, match=r"received nothing.*extend\(\) on the loss"),
        backpack(DiagBackpropExtension()),
    ):
        nn.CrossEntropyLoss()(net(x), y).backward()


def test_bad_first_step_option():
    with pytest.raises(ValueError, match="ce_first_step"):
        DiagBackpropExtension(ce_first_step="block")
