import copy

import pytest
import torch
from laplace import Laplace
from stochman import nnj
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext import BCEWithLogits, CrossEntropy, DiagBackprop, diag_backprop
from lsn_ext import stochman_ext as sx
from lsn_ext.models import UNet
from lsn_ext.rules import RULES
from tests.networks import tiny_unet
from tests.reference import dense_db, squared_input_rule

# BackPACK's hooks on the first layer, whose input needs no gradient, make torch warn.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TOL = {"rtol": 1e-10, "atol": 1e-12}


# -- helpers ---------------------------------------------------------------------------------------


def squared_all_params(module: nn.Module, x, m_out):
    """Per-sample ``(J_θ ∘ J_θ)ᵀ m_b`` over all parameters (recursively): ``[B, P]``."""
    params = {k: p.detach() for k, p in module.named_parameters()}
    rows = []
    for b in range(x.shape[0]):
        jac = jacrev(lambda p, b=b: functional_call(module, p, (x[b : b + 1],)))(params)
        m = m_out[b : b + 1].reshape(-1)
        rows.append(torch.cat([(jac[k].reshape(m.numel(), -1).square().T @ m) for k in params]))
    return torch.stack(rows)


def share(new: nn.Module, old: nn.Module) -> nn.Module:
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    return new


def to_sx(m: nn.Module) -> nn.Module:
    """The lsn_ext.stochman_ext layer equivalent to a torch layer of tests.networks.tiny_unet."""
    if type(m) is nn.Conv2d:
        return share(sx.Conv2d(m.in_channels, m.out_channels, m.kernel_size, padding=m.padding), m)
    if type(m) is nn.ConvTranspose2d:
        return share(sx.ConvTranspose2d(m.in_channels, m.out_channels, 2, stride=2), m)
    if type(m) is nn.Upsample:
        return sx.Upsample(scale_factor=m.scale_factor, mode=m.mode)
    if type(m) is nn.MaxPool2d:
        return sx.MaxPool2d(m.kernel_size)
    assert type(m) is nn.Tanh
    return sx.Tanh()


def nnj_tiny_unet(net, order: str) -> nnj.Sequential:
    """tests.networks.tiny_unet as nested SkipConnections, sharing the parameters of ``net``."""
    L = {k: to_sx(v) for k, v in net.layers.items() if k != "head"}
    head = net.layers["head"]
    head = share(sx.MeanHead(head.in_channels, head.out_channels), head)
    inner = sx.SkipConnection(L["p2"], L["b"], L["ab"], L["u2"], order=order)
    outer = sx.SkipConnection(
        L["p1"], L["e2"], L["a2"], inner, L["d2"], L["ad2"], L["u1"], order=order
    )
    # A plain StochMan Sequential at the top: the driver needs no lsn_ext container there.
    return nnj.Sequential(L["e1"], L["a1"], outer, L["d1"], L["ad1"], head)


def by_identity(result, model) -> dict[int, torch.Tensor]:
    return {id(p): result.diagonals[n] for n, p in model.named_parameters()}


def assert_same_diagonals(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TOL))


# -- per-module diag→diag sandwiches against jacrev -----------------------------------------------


def _batchnorm():
    bn = sx.BatchNorm2d(3).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _frozen_first_weight():
    # StochMan's weight sandwich covers every parameter, requires_grad or not.
    seq = sx.Sequential(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh(), sx.MaxPool2d(2))
    seq[0].weight.requires_grad_(False)
    return seq


# Each case is exact for DB (one parametric layer, then elementwise / 0-1 layers), so the
# sandwiches must equal the brute-force Σ_o J_oi² m_o.
MODULES = {
    "Linear": (lambda: sx.Linear(4, 3), (3, 4)),
    "Conv2d-stride1-pad1": (lambda: sx.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5)),
    "Conv2d-stride2-pad1-even": (lambda: sx.Conv2d(2, 3, 3, stride=2, padding=1), (2, 2, 6, 6)),
    "Conv2d-dilation2-groups2": (
        lambda: sx.Conv2d(2, 4, 3, padding=2, dilation=2, groups=2),
        (2, 2, 5, 5),
    ),
    "Conv1d": (lambda: sx.Conv1d(2, 3, 3), (2, 2, 7)),
    "ConvTranspose2d-stride2": (lambda: sx.ConvTranspose2d(2, 3, 2, stride=2), (2, 2, 3, 3)),
    "MeanHead": (lambda: sx.MeanHead(3, 2), (2, 3, 4, 4)),
    "Upsample-nearest-C3": (lambda: sx.Upsample(scale_factor=2), (2, 3, 3, 3)),
    "Upsample-bilinear-C3": (lambda: sx.Upsample(scale_factor=2, mode="bilinear"), (2, 3, 3, 3)),
    "Upsample-bilinear-size-align": (
        lambda: sx.Upsample(size=(5, 7), mode="bilinear", align_corners=True),
        (2, 2, 3, 4),
    ),
    "MaxPool2d": (lambda: sx.MaxPool2d(2), (2, 3, 4, 4)),
    "MaxPool2d-overlapping": (lambda: sx.MaxPool2d(3, stride=1), (2, 2, 4, 4)),
    "Tanh": (lambda: sx.Tanh(), (2, 3, 2, 2)),
    "Sigmoid": (lambda: sx.Sigmoid(), (2, 3, 2, 2)),
    "ReLU": (lambda: sx.ReLU(), (2, 3, 2, 2)),
    "LeakyReLU": (lambda: sx.LeakyReLU(0.2), (2, 3, 2, 2)),
    "ELU": (lambda: sx.ELU(), (2, 3, 2, 2)),
    "Softplus": (lambda: sx.Softplus(beta=2.0), (2, 3, 2, 2)),
    "Flatten": (lambda: sx.Flatten(), (2, 3, 2, 2)),
    "Reshape": (lambda: sx.Reshape(3, 4), (2, 12)),
    "Identity": (lambda: sx.Identity(), (2, 3)),
    "BatchNorm2d-eval": (_batchnorm, (2, 3, 2, 2)),
    "Sequential-conv-tanh-pool": (
        lambda: sx.Sequential(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh(), sx.MaxPool2d(2)),
        (2, 2, 4, 4),
    ),
    "SkipConnection-skip-first": (
        lambda: sx.SkipConnection(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh()),
        (2, 2, 4, 4),
    ),
    "SkipConnection-layers-first": (
        lambda: sx.SkipConnection(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh(), order="layers-first"),
        (2, 2, 4, 4),
    ),
    "SkipConnection-nested": (
        lambda: sx.SkipConnection(
            sx.SkipConnection(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh(), order="layers-first"),
            sx.Tanh(),
        ),
        (2, 2, 4, 4),
    ),
    "SkipConnection-pool-conv-upsample": (
        lambda: sx.SkipConnection(
            sx.MaxPool2d(2), sx.Conv2d(2, 3, 1), sx.Tanh(), sx.Upsample(scale_factor=2)
        ),
        (2, 2, 4, 4),
    ),
    "SkipConnection-dim-last": (
        lambda: sx.SkipConnection(sx.Conv2d(2, 2, 3, padding=1), dim=-1),
        (2, 2, 3, 4),
    ),
    "Sequential-frozen-weight": (_frozen_first_weight, (2, 2, 4, 4)),
}


@pytest.mark.parametrize("case", MODULES.values(), ids=MODULES.keys())
def test_diag_sandwiches_match_jacrev(case):
    make, shape = case
    module = make()
    x = torch.randn(shape)
    with torch.no_grad():
        val = module(x)
    m = torch.rand_like(val)
    B = x.shape[0]

    # StochMan's layout: flattened per sample in and out.
    m_in = module._jacobian_wrt_input_sandwich(x, val, m.reshape(B, -1), True, True)
    expected = squared_input_rule(module, x, m)
    assert m_in.shape == (B, x[0].numel())
    torch.testing.assert_close(m_in, expected.reshape(B, -1), **TOL)
    # Shaped like the output in, shaped like the input out.
    shaped = module._jacobian_wrt_input_sandwich(x, val, m, diag_inp=True, diag_out=True)
    torch.testing.assert_close(shaped.reshape(x.shape), expected, **TOL)
    assert shaped.shape == (x.shape if val.dim() > 2 else (B, x[0].numel()))
    assert (m_in >= 0).all()

    w = module._jacobian_wrt_weight_sandwich(x, val, m.reshape(B, -1), True, True)
    if not list(module.parameters()):
        assert w is None
    else:
        expected_w = squared_all_params(module, x, m)
        assert w.shape == expected_w.shape == (B, sum(p.numel() for p in module.parameters()))
        torch.testing.assert_close(w, expected_w, **TOL)


def test_container_sandwiches_with_a_weight_tied_across_layers():
    # DB of a tied weight sums the diagonals of its uses (no cross terms): built here from the
    # leaf sandwiches, which the jacrev test checks one by one.
    a, b = sx.Conv2d(2, 2, 1), sx.Conv2d(2, 2, 1)
    b.weight = a.weight
    seq = sx.Sequential(a, sx.Tanh(), b)
    x = torch.randn(2, 2, 3, 3)
    h = a(x)
    t = torch.tanh(h)
    y = b(t)
    m = torch.rand_like(y).reshape(2, -1)
    w_b = b._jacobian_wrt_weight_sandwich(t, y, m, True, True)
    m_t = b._jacobian_wrt_input_sandwich(t, y, m, True, True)
    m_h = seq[1]._jacobian_wrt_input_sandwich(h, t, m_t, True, True)
    w_a = a._jacobian_wrt_weight_sandwich(x, h, m_h, True, True)
    # seq.parameters(): a.weight (= b.weight), a.bias, b.bias
    expected_w = torch.cat([w_a[:, :4] + w_b[:, :4], w_a[:, 4:], w_b[:, 4:]], 1)
    torch.testing.assert_close(
        seq._jacobian_wrt_weight_sandwich(x, y, m, True, True), expected_w, **TOL
    )
    expected_in = a._jacobian_wrt_input_sandwich(x, h, m_h, True, True)
    torch.testing.assert_close(
        seq._jacobian_wrt_input_sandwich(x, y, m, True, True), expected_in, **TOL
    )


def test_container_sandwiches_leave_the_module_unchanged():
    seq = _frozen_first_weight()
    before = [(p, p.requires_grad) for p in seq.parameters()]
    x = torch.randn(2, 2, 4, 4)
    val = seq(x)
    m = torch.rand_like(val).reshape(2, -1)
    seq._jacobian_wrt_input_sandwich(x, val, m, True, True)
    seq._jacobian_wrt_weight_sandwich(x, val, m, True, True)
    assert [(p, p.requires_grad) for p in seq.parameters()] == before
    assert all(p.grad is None for p in seq.parameters())
    assert not x.requires_grad


def test_container_sandwiches_and_inference_mode():
    # The containers' sandwiches run the engine, which needs autograd: refused with a remedy
    # under inference_mode; tensors made there are fine outside it.
    seq = sx.Sequential(sx.Conv2d(2, 3, 3, padding=1), sx.Tanh())
    x = torch.randn(2, 2, 4, 4)
    val = seq(x)
    m = torch.rand_like(val).reshape(2, -1)
    expected = seq._jacobian_wrt_input_sandwich(x, val, m, True, True)
    with torch.inference_mode():
        x_inf, m_inf = x.clone(), m.clone()
        with pytest.raises(RuntimeError, match=r"outside the inference_mode block"):
            seq._jacobian_wrt_input_sandwich(x_inf, val, m_inf, True, True)
    got = seq._jacobian_wrt_input_sandwich(x_inf, val, m_inf, True, True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upsample_sandwich_dtype_and_channels(dtype, mode):
    up = sx.Upsample(scale_factor=2, mode=mode)
    x = torch.randn(2, 4, 3, 3, dtype=dtype)
    val = up(x)
    m = torch.rand_like(val)
    m_in = up._jacobian_wrt_input_sandwich(x, val, m.reshape(2, -1), True, True)
    assert m_in.dtype == dtype
    expected = squared_input_rule(up, x.double(), m.double()).reshape(2, -1)
    tol = TOL if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(m_in.double(), expected, **tol)


def test_stochman_upsample_diag_sandwich_is_wrong_and_ours_is_not():
    # The StochMan 0.3.0 trap this module fixes: its kernel sums over all channels.
    x = torch.randn(1, 3, 2, 2)
    m = torch.rand(1, 3, 4, 4)
    val = nn.functional.interpolate(x, scale_factor=2)
    theirs = nnj.Upsample(scale_factor=2)._jacobian_wrt_input_sandwich(
        x, val, m.reshape(1, -1), True, True
    )
    ours = sx.Upsample(scale_factor=2)._jacobian_wrt_input_sandwich(
        x, val, m.reshape(1, -1), True, True
    )
    expected = squared_input_rule(nn.Upsample(scale_factor=2), x, m).reshape(1, -1)
    torch.testing.assert_close(ours, expected, **TOL)
    assert (theirs - expected).abs().max() > 0.1


def test_full_paths_stay_stochman_or_raise():
    lin = sx.Linear(3, 2)
    x = torch.randn(2, 3)
    val = lin(x)
    full = torch.rand(2, 2, 2)
    torch.testing.assert_close(
        lin._jacobian_wrt_input_sandwich(x, val, full),
        nnj.Linear._jacobian_wrt_input_sandwich(lin, x, val, full),
        rtol=0,
        atol=0,
    )
    sig = sx.Sigmoid()
    with pytest.raises(NotImplementedError, match=r"no such path for nnj\.Sigmoid"):
        sig._jacobian_wrt_input_sandwich(x, sig(x), full)
    seq = sx.Sequential(sx.Linear(3, 2))
    with pytest.raises(NotImplementedError, match="only the diag→diag"):
        seq._jacobian_wrt_weight_sandwich(x, val, full, diag_inp=False, diag_out=False)


def test_skip_connection_jacobian_in_stochman_layout():
    sc = sx.SkipConnection(
        sx.Conv2d(2, 3, 3, padding=1),
        sx.SkipConnection(sx.Tanh(), order="layers-first"),
        sx.Upsample(scale_factor=1),
    )
    x = torch.randn(2, 2, 3, 3)
    val, jac = sc(x, jacobian=True)
    torch.testing.assert_close(val, sc(x), rtol=0, atol=0)
    for b in range(2):
        expected = jacrev(lambda z: sc(z.unsqueeze(0))[0])(x[b])
        torch.testing.assert_close(jac[b], expected, **TOL)


# -- whole networks: nnj driver = native engine = dense reference ----------------------------------

UNETS = {
    f"{up}-{order}": (up, order)
    for up, order in [
        ("nearest", "skip-first"),
        ("bilinear", "skip-first"),
        ("bilinear", "up-first"),
        ("transposed", "up-first"),
    ]
}


@pytest.mark.parametrize("case", UNETS.values(), ids=UNETS.keys())
def test_nnj_unet_bce_equals_engine_and_dense_reference(case):
    up, order = case
    net = tiny_unet(1, up, order)
    model = nnj_tiny_unet(net, "skip-first" if order == "skip-first" else "layers-first")
    x = torch.randn(2, 2, 8, 8)
    y = (torch.rand(2, 1, 8, 8) > 0.5).double()
    torch.testing.assert_close(model(x), net(x), rtol=0, atol=0)
    loss = BCEWithLogits(pos_weight=torch.tensor(3.0))

    got = sx.diag_backprop_nnj(model, x, y, loss)
    engine_plain = diag_backprop(net, x, y, loss)  # the equivalent plain nn.Module
    engine_nnj = diag_backprop(model, x, y, loss)  # the nnj model itself, through registration
    assert list(got.diagonals) == [n for n, _ in model.named_parameters()]
    assert_same_diagonals(by_identity(got, model), by_identity(engine_plain, net))
    assert_same_diagonals(by_identity(got, model), by_identity(engine_nnj, model))
    dense = dense_db(net, x, loss.hessian_diag(net(x).detach(), y))
    names = dict(net.named_parameters())
    assert_same_diagonals(by_identity(got, model), {id(names[k]): d for k, d in dense.items()})
    torch.testing.assert_close(got.loss, engine_plain.loss, **TOL)
    torch.testing.assert_close(got.vector, engine_nnj.vector, **TOL)


LOSSES = {
    "ce-exact": (3, lambda: torch.randint(0, 3, (2, 8, 8)), CrossEntropy(), "exact"),
    "ce-diag": (3, lambda: torch.randint(0, 3, (2, 8, 8)), "ce", "diag"),
    "ce-weighted-ignore": (
        3,
        lambda: torch.where(torch.rand(2, 8, 8) > 0.2, torch.randint(0, 3, (2, 8, 8)), -100),
        CrossEntropy(weight=torch.tensor([1.0, 2.0, 0.5])),
        "exact",
    ),
    "mse": (2, lambda: torch.randn(2, 2, 8, 8), "mse", "exact"),
}


@pytest.mark.parametrize("case", LOSSES.values(), ids=LOSSES.keys())
def test_nnj_unet_losses_equal_engine(case):
    out, targets, loss, first_step = case
    net = tiny_unet(out, "bilinear")
    model = nnj_tiny_unet(net, "skip-first")
    x, y = torch.randn(2, 2, 8, 8), targets()
    got = sx.diag_backprop_nnj(model, x, y, loss, ce_first_step=first_step)
    expected = diag_backprop(net, x, y, loss, ce_first_step=first_step)
    assert_same_diagonals(by_identity(got, model), by_identity(expected, net))
    torch.testing.assert_close(got.loss, expected.loss, **TOL)
    assert (got.vector >= 0).all()


def test_stochmans_own_layers_work_through_registration():
    # nnj.* classes, not lsn_ext's subclasses: registered with their parents' rules, so both
    # the driver and the native engine run them (bilinear upsampling of 3 channels included).
    model = nnj.Sequential(
        nnj.Conv2d(2, 3, 3, padding=1),
        nnj.Tanh(),
        sx.SkipConnection(
            nnj.MaxPool2d(2),
            nnj.Conv2d(3, 3, 3, padding=1),
            nnj.Sigmoid(),
            nnj.Upsample(scale_factor=2, mode="bilinear"),
        ),
        nnj.Conv2d(6, 2, 1),
    )
    x, y = torch.randn(2, 2, 4, 4), torch.randint(0, 2, (2, 4, 4))
    got = sx.diag_backprop_nnj(model, x, y, "ce")
    expected = diag_backprop(model, x, y, "ce")
    assert_same_diagonals(by_identity(got, model), by_identity(expected, model))


@pytest.mark.parametrize("upsampling", ["nearest", "bilinear", "transposed"])
def test_to_nnj_unet_shares_parameters_and_equals_engine(upsampling):
    unet = UNet(2, 3, widths=(2, 3, 4), upsampling=upsampling)
    model = sx.to_nnj(unet)
    assert {id(p) for p in model.parameters()} == {id(p) for p in unet.parameters()}
    assert isinstance(model[1], sx.MeanHead)
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    torch.testing.assert_close(model(x), unet(x), rtol=0, atol=0)
    got = sx.diag_backprop_nnj(model, x, y, "ce")
    assert_same_diagonals(by_identity(got, model), by_identity(diag_backprop(unet, x, y), unet))


def test_to_nnj_single_level_and_refusals():
    unet = UNet(2, 1, widths=(3,), activation=nn.ReLU)
    model = sx.to_nnj(unet)
    x = torch.randn(2, 2, 4, 4)
    torch.testing.assert_close(model(x), unet(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"converts lsn_ext\.models\.UNet"):
        sx.to_nnj(nn.Conv2d(1, 1, 1))
    odd = UNet(2, 1, widths=(2, 3), activation=nn.GELU)
    with pytest.raises(TypeError, match=r"'encoders\.0\.1' \(GELU\)"):
        sx.to_nnj(odd)


def test_float32_agrees_with_float64():
    torch.set_default_dtype(torch.float32)
    net = tiny_unet(3, "bilinear")
    model = nnj_tiny_unet(net, "skip-first")
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    got32 = sx.diag_backprop_nnj(model, x, y, "ce")
    engine32 = diag_backprop(net, x, y, "ce")
    assert got32.vector.dtype == torch.float32
    torch.testing.assert_close(got32.vector, engine32.vector, rtol=1e-5, atol=1e-8)
    model64 = copy.deepcopy(model).double()
    got64 = sx.diag_backprop_nnj(model64, x.double(), y, "ce")
    scale = got64.vector.abs().max()
    torch.testing.assert_close(
        got32.vector.double() / scale, got64.vector / scale, rtol=0, atol=1e-5
    )


def test_laplace_fit_on_nnj_unet_equals_driver():
    model = sx.to_nnj(UNet(2, 1, widths=(2, 3, 4)))
    x = torch.randn(6, 2, 8, 8)
    y = (torch.rand(6, 1, 8, 8) > 0.5).double()
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=DiagBackprop,
        backend_kwargs={"loss": "bce", "estimator": "db"},
    )
    la.fit(loader)
    expected = sum(sx.diag_backprop_nnj(model, xb, yb, "bce").vector for xb, yb in loader)
    torch.testing.assert_close(la.H, expected, **TOL)
    assert la.H.numel() == sum(p.numel() for p in model.parameters())


def test_backpack_adapter_agrees_on_the_plain_unet():
    backpack_ext = pytest.importorskip("lsn_ext.backpack_ext")
    from backpack import backpack, extend

    unet = UNet(2, 3, widths=(2, 3, 4), upsampling="bilinear")
    x, y = torch.randn(2, 2, 8, 8), torch.randint(0, 3, (2, 8, 8))
    bp_net = backpack_ext.convert(unet, x)
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(backpack_ext.DiagBackpropExtension()):
        lossfunc(bp_net(x), y).backward()
    from_backpack = backpack_ext.diagonals(bp_net)  # the names of unet
    model = sx.to_nnj(unet)
    got = by_identity(sx.diag_backprop_nnj(model, x, y, "ce"), model)
    names = dict(unet.named_parameters())
    assert_same_diagonals(got, {id(names[k]): d for k, d in from_backpack.items()})


def test_frozen_parameters_and_params_argument():
    net = tiny_unet(1, "nearest")
    model = nnj_tiny_unet(net, "skip-first")
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    full = sx.diag_backprop_nnj(model, x, y, "bce")
    head = model[5]
    sub = sx.diag_backprop_nnj(model, x, y, "bce", params=[head.weight])
    assert list(sub.diagonals) == ["5.weight"]
    torch.testing.assert_close(sub.diagonals["5.weight"], full.diagonals["5.weight"], **TOL)
    model[0].weight.requires_grad_(False)
    frozen = sx.diag_backprop_nnj(model, x, y, "bce")
    assert "0.weight" not in frozen.diagonals
    torch.testing.assert_close(frozen.diagonals["0.bias"], full.diagonals["0.bias"], **TOL)


def test_inplace_activation_and_shared_module():
    relu = nnj.ReLU(inplace=True)
    conv = sx.Conv2d(2, 2, 3, padding=1)
    model = nnj.Sequential(conv, relu, sx.SkipConnection(conv, relu), sx.MeanHead(4, 1))
    x, y = torch.randn(2, 2, 4, 4), (torch.rand(2, 1, 4, 4) > 0.5).double()
    got = sx.diag_backprop_nnj(model, x, y, "bce")
    expected = diag_backprop(model, x, y, "bce")
    assert_same_diagonals(by_identity(got, model), by_identity(expected, model))
    assert list(got.diagonals) == ["0.weight", "0.bias", "3.weight", "3.bias"]


# -- registration and errors ----------------------------------------------------------------------


def test_register_is_idempotent_and_exact_class():
    assert sx.register() == []
    for cls in (nnj.Conv2d, nnj.Linear, nnj.Upsample, nnj.MaxPool2d, nnj.Tanh, nnj.Reshape):
        assert cls in RULES
    for cls in (sx.Conv2d, sx.MeanHead, sx.Upsample):
        assert cls in RULES
    # Same parent class, different forward: deliberately not registered.
    assert nnj.ArcTanh not in RULES
    assert nnj.PosLinear not in RULES
    assert sx.SkipConnection not in RULES


def test_unsupported_nnj_module_error_names_class_path_and_how_to_register():
    model = nnj.Sequential(
        sx.Conv2d(2, 2, 1),
        sx.SkipConnection(sx.Conv2d(2, 2, 1), nnj.ArcTanh()),
        sx.MeanHead(4, 1),
    )
    x, y = torch.randn(1, 2, 2, 2), torch.zeros(1, 1, 2, 2)
    with pytest.raises(NotImplementedError) as info:
        sx.diag_backprop_nnj(model, x, y, "bce")
    msg = str(info.value)
    assert "stochman.nnj.ArcTanh at '1._F.1'" in msg
    assert "overrides forward" in msg
    assert "lsn_ext.register_rule" in msg
    assert "stochman.nnj.Conv2d" in msg  # the list of registered layers


def test_custom_container_and_unsupported_layer_are_refused():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = sx.Conv2d(2, 1, 1)

        def forward(self, x):
            return self.conv(x) * 2

    x, y = torch.randn(1, 2, 2, 2), torch.zeros(1, 1, 2, 2)
    with pytest.raises(NotImplementedError, match=r"Block at '0'.*Containers understood"):
        sx.diag_backprop_nnj(nnj.Sequential(Block()), x, y, "bce")
    with pytest.raises(NotImplementedError, match=r"stochman\.nnj\.Sqrt at '1'.*Write a"):
        sx.diag_backprop_nnj(nnj.Sequential(sx.Conv2d(2, 1, 1), nnj.Sqrt()), x, y, "bce")


def test_nnj_softmax_takes_the_softmax_rule():
    torch.manual_seed(0)
    conv, head = nnj.Conv2d(2, 3, 1), nnj.Conv2d(3, 1, 1)
    x, y = torch.randn(2, 2, 3, 3), (torch.rand(2, 1, 3, 3) > 0.5).double()
    stoch = sx.diag_backprop_nnj(nnj.Sequential(conv, nnj.Softmax(dim=1), head), x, y, "bce")
    plain = diag_backprop(nn.Sequential(conv, nn.Softmax(dim=1), head), x, y, "bce")
    torch.testing.assert_close(stoch.vector, plain.vector)
    assert stoch.vector.abs().sum() > 0


def test_exact_cross_entropy_needs_the_head_last():
    model = nnj.Sequential(sx.Conv2d(2, 2, 1), sx.SkipConnection(sx.Tanh()))
    x, y = torch.randn(1, 2, 2, 2), torch.randint(0, 4, (1, 2, 2))
    with pytest.raises(ValueError, match=r"come from '1' \(SkipConnection\)"):
        sx.diag_backprop_nnj(model, x, y, "ce")
    res = sx.diag_backprop_nnj(model, x, y, "ce", ce_first_step="diag")
    assert (res.vector >= 0).all()


def test_bad_arguments_and_shapes():
    with pytest.raises(ValueError, match="order must be"):
        sx.SkipConnection(sx.Tanh(), order="up-first")
    with pytest.raises(ValueError, match="non-batch dimension"):
        sx.SkipConnection(sx.Tanh(), dim=0)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="must agree in every dimension except 1"):
        sx.SkipConnection(sx.MaxPool2d(2))(torch.randn(1, 1, 4, 4))
    conv = sx.Conv2d(2, 2, 1)
    x = torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match=r"flattened per sample, \[2, 18\]"):
        conv._jacobian_wrt_input_sandwich(x, conv(x), torch.rand(2, 5), True, True)
    bn = sx.BatchNorm2d(2)  # training mode
    with pytest.raises(ValueError, match=r"'0' \(BatchNorm2d\).*model.eval"):
        sx.diag_backprop_nnj(
            nnj.Sequential(bn, sx.MeanHead(2, 1)), x, torch.zeros(2, 1, 3, 3), "bce"
        )
    with pytest.raises(ValueError, match="ce_first_step"):
        sx.diag_backprop_nnj(
            nnj.Sequential(conv), x, torch.zeros(2, 3, 3).long(), "ce", ce_first_step="x"
        )
    assert lsn_ext.rules.get_rule(conv) is RULES[sx.Conv2d]
