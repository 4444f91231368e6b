"""GGN-vector products of :class:`lsn_ext.lowrank.GGNOperator` against the dense GGN.

The reference is ``Σ_batches Jᵀ H J`` from ``torch.func.jacrev`` (``J``) and
``torch.func.hessian`` of the loss (``H``), float64; where the dense Jacobian is too large
(a transformer U-Net) the reference is ``torch.func``'s own ``jvp`` then ``vjp``, and on a plain
tensor model also curvlinops' ``GGNLinearOperator``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp, vjp

from lsn_ext.lowrank import GGNOperator, loss_hessian_product
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy
from tests.lowrank.dense import dense_ggn
from tests.model_state import assert_unchanged, snapshot
from tests.networks import SHARING_NETS, tiny_unet
from tests.reference import loss_hessian_dense


class Net3d(nn.Module):
    """Conv3d → GroupNorm → tanh → max-pool → Conv3d → trilinear upsampling → cat → 1×1×1 head."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Tanh())
        self.down = nn.MaxPool3d(2)
        self.mid = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Tanh())
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.head = nn.Conv3d(4, classes, 1)

    def forward(self, x):
        s = self.enc(x)
        return self.head(torch.cat([s, self.up(self.mid(self.down(s)))], 1))


def _batches(shape, classes, loss, n=2, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, *shape, generator=gen)
        spatial = shape[1:]
        if isinstance(loss, CrossEntropy):
            y = torch.randint(0, classes, (batch, *spatial), generator=gen)
        elif isinstance(loss, BCEWithLogits):
            y = (torch.rand(batch, classes, *spatial, generator=gen) > 0.6).double()
        else:
            y = torch.randn(batch, classes, *spatial, generator=gen)
        out.append((x, y))
    return out


CASES = {
    "unet-2d-ce": (lambda: tiny_unet(3), (2, 8, 8), 3, CrossEntropy()),
    "unet-2d-bce-pos-weight": (lambda: tiny_unet(1), (2, 8, 8), 1, BCEWithLogits(pos_weight=3.0)),
    "unet-2d-transposed-mse": (lambda: tiny_unet(2, up="transposed"), (2, 8, 8), 2, MSE()),
    "net-3d-ce": (Net3d, (1, 4, 4, 4), 2, CrossEntropy()),
    "ce-ignore-index": (lambda: tiny_unet(2), (2, 8, 8), 2, CrossEntropy(ignore_index=1)),
}


@pytest.mark.parametrize("name", CASES, ids=str)
def test_product_matches_dense_ggn(name):
    build, shape, classes, loss = CASES[name]
    torch.manual_seed(0)
    model = build().eval()
    batches = _batches(shape, classes, loss)
    G = dense_ggn(model, batches, loss)
    op = GGNOperator(model, batches, loss)
    before = snapshot(model)
    for seed in range(2):
        v = torch.randn(op.dim, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(op.matvec(v), G @ v, rtol=1e-10, atol=1e-12)
    assert_unchanged(model, before)
    assert op.forward_mode  # group norm, transposed convolutions: no fallback needed
    expected = sum(loss.value(model(x), y) for x, y in batches)
    torch.testing.assert_close(op.loss_value, expected.detach())


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n == "dynunet" else n for n in SHARING_NETS],
    ids=str,
)
def test_product_on_shared_and_tied_parameters(name):
    # Modules under two names and weights tied across modules: the parameter appears once.
    pytest.importorskip("monai") if name == "dynunet" else None
    if name == "plainconvunet":
        pytest.importorskip("dynamic_network_architectures")
    torch.manual_seed(0)
    model = SHARING_NETS[name]().double().eval()
    loss = CrossEntropy()
    batches = _batches((1, 8, 8), 2, loss, n=1)
    G = dense_ggn(model, batches, loss)
    op = GGNOperator(model, batches, loss)
    v = torch.randn(op.dim)
    torch.testing.assert_close(op.matvec(v), G @ v, rtol=1e-10, atol=1e-12)


def test_frozen_parameters_are_left_out():
    torch.manual_seed(0)
    model = tiny_unet(2).eval()
    model.layers["e1"].weight.requires_grad_(False)
    loss = CrossEntropy()
    batches = _batches((2, 8, 8), 2, loss, n=1)
    op = GGNOperator(model, batches, loss)
    assert op.dim == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert "layers.e1.weight" not in op.names
    v = torch.randn(op.dim)
    torch.testing.assert_close(op.matvec(v), dense_ggn(model, batches, loss) @ v)


def test_double_backward_route_equals_forward_mode():
    torch.manual_seed(0)
    model = tiny_unet(2).eval()
    loss = CrossEntropy()
    batches = _batches((2, 8, 8), 2, loss)
    op = GGNOperator(model, batches, loss)
    v = torch.randn(op.dim)
    forward = op.matvec(v)
    op.forward_mode = False
    torch.testing.assert_close(op.matvec(v), forward, rtol=1e-11, atol=1e-12)


class _NoForwardAD(torch.autograd.Function):
    """Identity with a backward (twice differentiable) but no forward-mode rule."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def test_operation_without_forward_ad_falls_back_with_a_warning():
    torch.manual_seed(0)
    inner = tiny_unet(2).eval()

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = inner

        def forward(self, x):
            return _NoForwardAD.apply(self.net(x))

    model = Wrapped().eval()
    loss = CrossEntropy()
    batches = _batches((2, 8, 8), 2, loss, n=1)
    op = GGNOperator(model, batches, loss)
    v = torch.randn(op.dim)
    with pytest.warns(RuntimeWarning, match="without forward-mode AD"):
        product = op.matvec(v)
    assert not op.forward_mode
    torch.testing.assert_close(product, dense_ggn(inner, batches, loss) @ v)


def test_transformer_unet_matches_torch_func_jvp_then_vjp():
    pytest.importorskip("monai")
    from monai.networks.nets import UNETR

    torch.manual_seed(0)
    model = UNETR(
        in_channels=1, out_channels=2, img_size=(16, 16), feature_size=2, hidden_size=8,
        mlp_dim=8, num_heads=2, spatial_dims=2,
    ).double().eval()  # fmt: skip
    loss = CrossEntropy()
    batches = _batches((1, 16, 16), 2, loss, n=1)
    op = GGNOperator(model, batches, loss)
    v = torch.randn(op.dim)
    names = op.names
    primals = tuple(model.get_parameter(n).detach() for n in names)
    pieces = tuple(
        t.view_as(p) for t, p in zip(v.split([p.numel() for p in primals]), primals, strict=True)
    )
    x, y = batches[0]

    def f(*theta):
        return functional_call(model, dict(zip(names, theta, strict=True)), (x,))

    out, jv = jvp(f, primals, pieces)
    _, pullback = vjp(f, *primals)
    H = loss_hessian_dense(lambda logits: loss.value(logits, y), out)
    expected = torch.cat([g.reshape(-1) for g in pullback((H @ jv.reshape(-1)).view_as(out))])
    torch.testing.assert_close(op.matvec(v), expected, rtol=1e-9, atol=1e-12)


def test_matches_curvlinops_ggn_linear_operator():
    from curvlinops import GGNLinearOperator

    torch.manual_seed(0)
    model = tiny_unet(2).eval()
    batches = _batches((2, 8, 8), 2, CrossEntropy())
    params = [p for p in model.parameters() if p.requires_grad]
    reference = GGNLinearOperator(
        model, nn.CrossEntropyLoss(reduction="sum"), params, batches, check_deterministic=False
    )
    op = GGNOperator(model, batches, CrossEntropy())
    v = torch.randn(op.dim)
    torch.testing.assert_close(op.matvec(v), reference @ v, rtol=1e-10, atol=1e-12)


def test_loss_hessian_product_uses_the_block_for_cross_entropy():
    logits = torch.randn(2, 3, 4, 4)
    y = torch.randint(0, 3, (2, 4, 4))
    u = torch.randn_like(logits)
    loss = CrossEntropy()
    H = loss_hessian_dense(lambda f: loss.value(f, y), logits)
    expected = (H @ u.reshape(-1)).view_as(u)
    torch.testing.assert_close(loss_hessian_product(loss, logits, y, u), expected)


def test_training_mode_batch_norm_is_refused():
    model = SHARING_NETS["plain"]().double().train()
    with pytest.raises(ValueError, match=r"bn \(BatchNorm2d\) is in training mode"):
        GGNOperator(model, [], CrossEntropy())


def test_bad_vector_and_empty_data_are_refused():
    model = tiny_unet(2).eval()
    op = GGNOperator(model, [], CrossEntropy())
    with pytest.raises(ValueError, match=r"v must have shape \(\d+,\), got \(3,\)"):
        op.matvec(torch.zeros(3))
    with pytest.raises(ValueError, match="no batches"):
        op.matvec(torch.zeros(op.dim))


def test_all_frozen_model_is_refused():
    model = tiny_unet(2).eval().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        GGNOperator(model, [], CrossEntropy())


def test_no_warning_on_ordinary_networks():
    model = tiny_unet(2).eval()
    loss = CrossEntropy()
    op = GGNOperator(model, _batches((2, 8, 8), 2, loss, n=1), loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op.matvec(torch.randn(op.dim))
    assert op.forward_mode
