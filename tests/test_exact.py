import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from lsn_ext.exact import exact_ggn_diagonal, flatten_diagonals, mc_ggn_diagonal
from lsn_ext.models import UNet
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, as_loss
from tests.reference import dense_block


def dense_ggn_diagonal(model, inputs, targets, loss):
    """``diag(Jᵀ H J)`` from the full Jacobian of the batch output and the dense loss Hessian."""
    loss = as_loss(loss)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}

    def f(p):
        return functional_call(
            model, {**{k: b.clone() for k, b in buffers.items()}, **p}, (inputs,)
        )

    out = f(params).detach()
    jac = jacrev(f)(params)
    J = torch.cat([jac[k].reshape(out.numel(), -1) for k in params], dim=1)  # [O, P]
    block = loss.hessian_block(out, targets)
    if block is None:
        H = torch.diag(loss.hessian_diag(out, targets).reshape(-1))
    else:
        H = dense_block(block, out.shape)
    diag = torch.einsum("op,oq,qp->p", J, H, J)
    return dict(zip(params, diag.split([p.numel() for p in params.values()]), strict=True))


def _bce(out_shape):
    targets = (torch.rand(out_shape) > 0.5).double()
    return BCEWithLogits(pos_weight=2.5), targets


def _bce_nchw_targets(out_shape):
    return "bce", (torch.rand(out_shape[:1] + out_shape[2:]) > 0.4).double()


def _ce(out_shape):
    targets = torch.randint(0, out_shape[1], out_shape[:1] + out_shape[2:])
    targets[0, :2, :3] = -1
    return CrossEntropy(weight=torch.tensor([0.5, 1.0, 2.0]), ignore_index=-1), targets


def _mse(out_shape):
    return MSE(), torch.randn(out_shape)


def _mse_module_mean(out_shape):
    return nn.MSELoss(reduction="mean"), torch.randn(out_shape)


CASES = {
    "bce-pos_weight": (1, {}, _bce),
    "bce-NHW-targets-transposed": (1, {"upsampling": "transposed"}, _bce_nchw_targets),
    "ce-3-classes-ignore-weights": (3, {}, _ce),
    "ce-3-classes-bilinear": (3, {"upsampling": "bilinear"}, _ce),
    "mse-2-channels": (2, {}, _mse),
    "mseloss-mean": (2, {"activation": nn.Sigmoid}, _mse_module_mean),
}


@pytest.fixture(params=CASES.values(), ids=CASES.keys())
def unet_case(request):
    out_channels, kwargs, make = request.param
    model = UNet(2, out_channels, widths=(2, 3), **kwargs)
    inputs = torch.randn(2, 2, 8, 8)
    loss, targets = make((2, out_channels, 8, 8))
    return model, inputs, targets, loss


def test_matches_dense_jacobian(unet_case):
    model, inputs, targets, loss = unet_case
    expected = dense_ggn_diagonal(model, inputs, targets, loss)
    diag = exact_ggn_diagonal(model, inputs, targets, loss, chunk_size=100)
    assert list(diag) == [k for k, _ in model.named_parameters()]
    for k, p in model.named_parameters():
        assert diag[k].shape == p.shape, k
        torch.testing.assert_close(diag[k].reshape(-1), expected[k], rtol=1e-10, atol=1e-12)
        assert (diag[k] >= 0).all(), k
    assert sum(d.sum() for d in diag.values()) > 0


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000], ids=lambda c: f"chunk{c}")
def test_chunk_size_does_not_change_result(chunk_size):
    model = UNet(1, 3, widths=(2, 3))
    inputs, targets = torch.randn(1, 1, 4, 4), torch.randint(0, 3, (1, 4, 4))
    ref = exact_ggn_diagonal(model, inputs, targets, "ce", chunk_size=256)
    diag = exact_ggn_diagonal(model, inputs, targets, "ce", chunk_size=chunk_size)
    for k in ref:
        torch.testing.assert_close(diag[k], ref[k], rtol=1e-12, atol=1e-14)


def test_train_mode_batchnorm_is_exact_and_model_unchanged():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(), nn.Conv2d(3, 1, 1)
    ).train()
    inputs, targets = torch.randn(3, 2, 4, 4), (torch.rand(3, 1, 4, 4) > 0.5).double()
    state = copy.deepcopy(model.state_dict())
    diag = exact_ggn_diagonal(model, inputs, targets, "bce")
    expected = dense_ggn_diagonal(model, inputs, targets, "bce")
    for k in diag:
        torch.testing.assert_close(diag[k].reshape(-1), expected[k], rtol=1e-10, atol=1e-12)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0, msg=k)
    assert all(p.grad is None for p in model.parameters())
    assert model.training


def test_frozen_parameters_are_left_out():
    model = UNet(1, 1, widths=(2, 3))
    model.head.bias.requires_grad_(False)
    inputs, targets = torch.randn(1, 1, 4, 4), torch.rand(1, 1, 4, 4)
    diag = exact_ggn_diagonal(model, inputs, targets, "bce")
    assert "head.bias" not in diag
    assert "head.weight" in diag
    flat = flatten_diagonals(model, diag)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert flat.shape == (sum(p.numel() for p in trainable),)
    torch.testing.assert_close(flat[-1], diag["head.weight"].reshape(-1)[-1])


def test_flatten_follows_parameters_order():
    model = UNet(1, 1, widths=(2, 3))
    diags = {k: torch.full_like(p, float(i)) for i, (k, p) in enumerate(model.named_parameters())}
    flat = flatten_diagonals(model, diags)
    expected = torch.cat(
        [torch.full((p.numel(),), float(i)) for i, p in enumerate(model.parameters())]
    )
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)
    del diags["head.bias"]
    with pytest.raises(KeyError, match=r"head\.bias"):
        flatten_diagonals(model, diags)


def test_argument_errors():
    model = UNet(1, 1, widths=(2,))
    inputs, targets = torch.randn(1, 1, 2, 2), torch.rand(1, 1, 2, 2)
    with pytest.raises(ValueError, match="chunk_size"):
        exact_ggn_diagonal(model, inputs, targets, "bce", chunk_size=0)
    with pytest.raises(ValueError, match="mc_samples"):
        mc_ggn_diagonal(model, inputs, targets, "bce", mc_samples=0)
    with pytest.raises(ValueError, match="unknown loss"):
        exact_ggn_diagonal(model, inputs, targets, "hinge")
    with pytest.raises(ValueError, match="requires_grad"):
        exact_ggn_diagonal(model.requires_grad_(False), inputs, targets, "bce")


def _rel_err(d, ref):
    return ((d - ref).norm() / ref.norm()).item()


MC_CASES = {
    "bce-pos_weight": (
        1,
        lambda s: (BCEWithLogits(pos_weight=3.0), (torch.rand(s) > 0.5).double()),
    ),
    "ce-weights-ignore": (
        3,
        lambda s: (
            CrossEntropy(weight=torch.tensor([0.5, 1.0, 2.0]), ignore_index=-1),
            torch.randint(-1, 3, s[:1] + s[2:]),
        ),
    ),
    "mse-mean": (2, lambda s: (MSE(reduction="mean"), torch.randn(s))),
}


@pytest.mark.parametrize("case", MC_CASES.values(), ids=MC_CASES.keys())
def test_mc_is_unbiased(case):
    out_channels, make = case
    model = UNet(2, out_channels, widths=(2, 3))
    inputs = torch.randn(2, 2, 4, 4)
    loss, targets = make((2, out_channels, 4, 4))
    exact = flatten_diagonals(model, exact_ggn_diagonal(model, inputs, targets, loss))
    gen = torch.Generator().manual_seed(1)
    one = flatten_diagonals(model, mc_ggn_diagonal(model, inputs, targets, loss, generator=gen))
    many = mc_ggn_diagonal(model, inputs, targets, loss, mc_samples=3000, generator=gen)
    many = flatten_diagonals(model, many)
    assert _rel_err(many, exact) < 0.06
    assert _rel_err(one, exact) > 2 * _rel_err(many, exact)  # one draw is much noisier
    assert (many >= 0).all()


def test_mc_bce_one_draw_is_squared_gradient_at_sampled_targets():
    # Plain BCE, one sample in the batch: the estimate is grad(ℓ(f, ỹ))² with ỹ ~ Bernoulli(σ(f)).
    model = UNet(1, 1, widths=(2, 3))
    inputs = torch.randn(1, 1, 4, 4)
    diag = mc_ggn_diagonal(
        model, inputs, torch.zeros(1, 1, 4, 4), "bce", generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        p = torch.sigmoid(model(inputs))
    sampled = torch.bernoulli(p.unsqueeze(0), generator=torch.Generator().manual_seed(3))[0]
    nn.BCEWithLogitsLoss(reduction="sum")(model(inputs), sampled).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(diag[k], p.grad.square(), rtol=1e-10, atol=1e-14, msg=k)


BACKPACK_CASES = {
    "ce-conv": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 1)),
        lambda: torch.randint(0, 3, (2, 4, 4)),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
    ),
    "bce-conv-linear": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 1)
        ),
        lambda: (torch.rand(2, 1) > 0.5).double(),
        lambda: nn.BCEWithLogitsLoss(reduction="sum"),
    ),
}


@pytest.mark.parametrize("case", BACKPACK_CASES.values(), ids=BACKPACK_CASES.keys())
def test_mc_agrees_with_backpack_diag_ggn_mc(case):
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import DiagGGNMC

    make_model, make_targets, make_loss = case
    model = make_model()
    inputs, targets, loss_fn = torch.randn(2, 2, 4, 4), make_targets(), make_loss()
    exact = flatten_diagonals(model, exact_ggn_diagonal(model, inputs, targets, loss_fn))
    ours = mc_ggn_diagonal(
        model,
        inputs,
        targets,
        loss_fn,
        mc_samples=4000,
        generator=torch.Generator().manual_seed(0),
    )
    ours = flatten_diagonals(model, ours)

    bp_model = backpack.extend(copy.deepcopy(model))  # extend() breaks torch.func: use a copy
    bp_loss = backpack.extend(make_loss())
    with backpack.backpack(DiagGGNMC(mc_samples=4000)):
        bp_loss(bp_model(inputs.clone().requires_grad_()), targets).backward()
    theirs = torch.cat([p.diag_ggn_mc.reshape(-1) for p in bp_model.parameters()])

    assert _rel_err(theirs, exact) < 0.06
    assert _rel_err(ours, exact) < 0.06
    assert _rel_err(ours, theirs) < 0.1
