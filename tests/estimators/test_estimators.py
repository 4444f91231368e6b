import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

import lsn_ext
from lsn_ext.estimators import per_sample, planner
from lsn_ext.estimators.monte_carlo import monte_carlo
from lsn_ext.estimators.per_sample import direct_sample_grads, square_sum
from lsn_ext.estimators.planner import Verified
from lsn_ext.estimators.replay import Owner
from lsn_ext.exact import exact_ggn_diagonal, flatten_diagonals
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy
from tests.networks import classifier, residual_net, tiny_unet


def _targets(loss, out_shape):
    if isinstance(loss, CrossEntropy):
        y = torch.randint(0, out_shape[1], out_shape[:1] + out_shape[2:])
        if loss.ignore_index >= 0:
            y[0, ..., 0] = loss.ignore_index
        return y
    if isinstance(loss, BCEWithLogits):
        return (torch.rand(out_shape) > 0.5).double()
    return torch.randn(out_shape)


LOSSES = {
    "bce": BCEWithLogits(),
    "bce-pos-weight-mean": BCEWithLogits(pos_weight=2.5, reduction="mean"),
    "bce-element-weight": BCEWithLogits(weight=torch.rand(1, 3, 2, 2)),
    "ce": CrossEntropy(),
    "ce-weight-ignore": CrossEntropy(weight=torch.tensor([0.5, 2.0, 1.0]), ignore_index=1),
    "ce-mean-smoothing": CrossEntropy(reduction="mean", label_smoothing=0.1),
    "mse": MSE(),
    "mse-mean-factor": MSE(reduction="mean", factor=1.0),
}


@pytest.mark.parametrize("name", LOSSES)
def test_hessian_sqrt_squares_to_the_loss_hessian(name):
    """``Σ_j (B e_j)(B e_j)ᵀ = B Bᵀ`` equals the dense Hessian of the loss value."""
    loss = LOSSES[name]
    f = torch.randn(2, 3, 2, 2)
    y = _targets(loss, f.shape)
    basis = torch.eye(f.numel()).reshape(f.numel(), *f.shape)
    S = loss.hessian_sqrt(f, y, basis).reshape(f.numel(), -1)
    H = hessian(lambda g: loss.value(g, y))(f).reshape(f.numel(), f.numel())
    torch.testing.assert_close(S.T @ S, H, atol=1e-12, rtol=1e-10)


def _dense_mc(model, x, y, loss, noise):
    """``(1/S) Σ_s Σ_n (J_nᵀ B_n z_sn)²`` from per-sample Jacobians (jacrev, no vmap)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = model(x).detach()
    vectors = loss.hessian_sqrt(out, y, noise)  # [S, N, ...]
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    for n in range(x.shape[0]):
        jac = jacrev(lambda p, n=n: functional_call(model, p, (x[n : n + 1],)))(params)
        for s in vectors:
            for k, j in jac.items():
                g = torch.tensordot(s[n : n + 1], j, dims=s[n : n + 1].dim())
                total[k] += g.square()
    return {k: v / noise.shape[0] for k, v in total.items()}


NETWORKS = {
    "tiny-unet-bce": (lambda: tiny_unet(1), (2, 2, 8, 8), BCEWithLogits(pos_weight=2.0)),
    "tiny-unet-transposed-ce": (
        lambda: tiny_unet(3, up="transposed", order="up-first"),
        (2, 2, 8, 8),
        CrossEntropy(weight=torch.tensor([1.0, 2.0, 0.5])),
    ),
    "residual-batchnorm-mse": (lambda: residual_net().eval(), (2, 2, 6, 6), MSE()),
    "classifier-ce": (classifier, (3, 2, 5, 5), CrossEntropy()),
}


@pytest.mark.parametrize("name", NETWORKS)
def test_mc_equals_dense_per_sample_reference(name):
    build, in_shape, loss = NETWORKS[name]
    model = build()
    x = torch.randn(in_shape)
    out_shape = model(x).shape
    y = _targets(loss, out_shape)
    noise = torch.randn(3, *out_shape)
    got = monte_carlo(model, x, y, loss, 3, None, None, noise).diagonals
    want = _dense_mc(model, x, y, loss, noise)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-9)


class _Shared(nn.Module):
    """One convolution applied twice, an in-place ReLU after it, and an unused branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.unused = nn.Conv2d(2, 2, 1)
        self.head = nn.Conv2d(2, 1, 1)

    def forward(self, x):
        self.unused(x).detach()
        return self.head(self.conv(self.act(self.conv(x))))


def test_mc_sums_a_shared_module_over_its_calls_before_squaring():
    model = _Shared()
    x = torch.randn(2, 2, 5, 5)
    y = (torch.rand(2, 1, 5, 5) > 0.5).double()
    noise = torch.randn(2, 2, 1, 5, 5)
    loss = BCEWithLogits()
    got = monte_carlo(model, x, y, loss, 2, None, None, noise).diagonals
    want = _dense_mc(model, x, y, loss, noise)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-9)
    assert got["unused.weight"].abs().sum() == 0


UNBIASED = {
    "bce": (lambda: tiny_unet(1, up="bilinear"), BCEWithLogits(pos_weight=3.0)),
    "ce": (lambda: tiny_unet(3, up="bilinear"), CrossEntropy()),
    "mse": (lambda: tiny_unet(2, up="nearest"), MSE()),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", UNBIASED)
def test_mc_is_unbiased_over_seeds(name):
    """The mean over 300 seeds matches the exact diagonal within 5 standard errors, everywhere."""
    build, loss = UNBIASED[name]
    model = build()
    x = torch.randn(2, 2, 4, 4)
    y = _targets(loss, model(x).shape)
    exact = flatten_diagonals(model, exact_ggn_diagonal(model, x, y, loss))
    draws = torch.stack(
        [
            lsn_ext.ggn_diagonal(
                model, x, y, loss, estimator="mc", generator=torch.Generator().manual_seed(s)
            ).vector
            for s in range(300)
        ]
    )
    mean, se = draws.mean(0), draws.std(0) / draws.shape[0] ** 0.5
    assert (draws.std(0) > 0).any()  # the estimator is random
    assert ((mean - exact).abs() <= 5 * se + 1e-12 * exact.abs().max()).all()
    assert (mean.sum() - exact.sum()).abs() <= 5 * draws.sum(1).std() / draws.shape[0] ** 0.5


def _norm_inplace():
    """The reported reproducer: an affine InstanceNorm (whose output is a view) then in place."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.InstanceNorm2d(4, affine=True),
        nn.LeakyReLU(0.1, inplace=True),
        nn.Conv2d(4, 1, 3, padding=1),
    )


class _ResidualInplace(nn.Module):
    """GroupNorm output changed by ``+=`` and an in-place activation (residual blocks)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.act = nn.LeakyReLU(0.01, inplace=True)
        self.skip = nn.Conv2d(2, 4, 1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        out = self.norm(self.conv(x))
        out += self.skip(x)
        return self.head(self.act(out))


IN_PLACE = {
    "instancenorm-leakyrelu-inplace-bce": (_norm_inplace, (3, 1, 4, 4), BCEWithLogits()),
    "groupnorm-residual-iadd-ce": (_ResidualInplace, (2, 2, 4, 4), CrossEntropy()),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_PLACE)
def test_mc_is_unbiased_with_in_place_ops_after_norm_views(name):
    """Every norm parameter gets its curvature (it read exactly 0 before), unbiased over seeds."""
    build, in_shape, loss = IN_PLACE[name]
    model = build().double().eval()
    x = torch.randn(in_shape)
    y = _targets(loss, model(x).shape)
    exact = exact_ggn_diagonal(model, x, y, loss)
    top = max(float(e.abs().max()) for e in exact.values())
    draws = {k: [] for k in exact}
    for s in range(300):
        res = lsn_ext.ggn_diagonal(
            model, x, y, loss, estimator="mc", generator=torch.Generator().manual_seed(s)
        )
        for k, d in res.diagonals.items():
            draws[k].append(d)
    for k, want in exact.items():
        d = torch.stack(draws[k])
        mean, se = d.mean(0), d.std(0) / d.shape[0] ** 0.5
        assert ((mean - want).abs() <= 5 * se + 1e-12 * top).all(), k
        if want.sum() > 1e-8 * top:
            assert mean.sum() > 0, f"{k}: exact curvature {want.sum():.3g}, estimate 0"
    for k in ("1.weight", "1.bias") if "instancenorm" in name else ("norm.weight", "norm.bias"):
        assert exact[k].sum() > 1e-3


def test_mc_equals_dense_reference_after_in_place_ops():
    model = _ResidualInplace().eval()
    x = torch.randn(2, 2, 4, 4)
    y = _targets(CrossEntropy(), model(x).shape)
    noise = torch.randn(2, 2, 2, 4, 4)
    got = monte_carlo(model, x, y, CrossEntropy(), 2, None, None, noise).diagonals
    want = _dense_mc(model, x, y, CrossEntropy(), noise)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("fault", ["hook-never-fires", "wrong-per-sample-gradients"])
def test_mc_serves_a_capture_lost_in_the_first_draw_through_the_whole_model(fault, monkeypatch):
    """Per-sample gradients that go missing in the first draw are taken through the whole model
    (``mc_paths`` says so) instead of being returned as zeros or a wrong estimate."""
    real_add, real_grads = Owner.add, Owner.sample_grads

    def add(self, grads):
        if self.path != "0":
            real_add(self, grads)

    def halved(self, x, g, *out):
        grads = real_grads(self, x, g, *out)
        return {k: v / 2 for k, v in grads.items()} if self.path == "0" else grads

    if fault == "hook-never-fires":
        monkeypatch.setattr(Owner, "add", add)
    else:
        monkeypatch.setattr(Owner, "sample_grads", halved)
    model = _norm_inplace().eval()
    x = torch.randn(2, 1, 4, 4)
    y = torch.rand(2, 1, 4, 4).round()
    noise = torch.randn(2, 2, 1, 4, 4)
    res = monte_carlo(model, x, y, BCEWithLogits(), 2, None, None, noise)
    # '0.bias' has a zero gradient (the instance norm removes it): a wrong per-sample value of
    # it is not checked, a missing one is.
    lost = ["0.weight", "0.bias"] if fault == "hook-never-fires" else ["0.weight"]
    assert res.mc_paths == {k: "model" if k in lost else "module" for k in res.diagonals}
    want = _dense_mc(model, x, y, BCEWithLogits(), noise)
    for k in want:
        torch.testing.assert_close(res.diagonals[k], want[k], atol=1e-12, rtol=1e-9)


def test_mc_refuses_a_capture_lost_after_the_first_draw(monkeypatch):
    real = Owner.sample_grads
    calls = []

    def halved_later(self, x, g, *out):
        calls.append(self.path)
        grads = real(self, x, g, *out)
        return {k: v / 2 for k, v in grads.items()} if len(calls) > 3 else grads

    monkeypatch.setattr(Owner, "sample_grads", halved_later)
    model = _norm_inplace().eval()
    x = torch.randn(2, 1, 4, 4)
    match = r"gradients of '0.weight' in '0' \(Conv2d\): they sum to a different .*first draw"
    with pytest.raises(RuntimeError, match=match):
        lsn_ext.ggn_diagonal(
            model, x, torch.rand(2, 1, 4, 4).round(), "bce", estimator="mc", mc_samples=2
        )


def test_mc_handles_group_norm_on_a_one_by_one_map():
    """Eval-mode GroupNorm over one value per group: the per-sample replay must not fail."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(4, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)
    ).eval()
    x = torch.randn(3, 2, 3, 3)
    y = torch.randint(0, 3, (3,))
    noise = torch.randn(2, 3, 3)
    got = monte_carlo(model, x, y, CrossEntropy(), 2, None, None, noise).diagonals
    # Reference: the batch's Jacobian (torch refuses this GroupNorm on one sample alone).
    params = {k: p.detach() for k, p in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)  # [N, 3, *shape]
    vectors = CrossEntropy().hessian_sqrt(model(x).detach(), y, noise)  # [S, N, 3]
    for k, j in jac.items():
        g = torch.einsum("snc,nc...->sn...", vectors, j)
        torch.testing.assert_close(got[k], g.square().sum((0, 1)) / 2, atol=1e-12, rtol=1e-9)
    assert got["1.bias"].sum() > 0


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 2, 1)
        self.b = nn.Conv2d(1, 2, 1)

    def forward(self, x):
        return [self.a(x), self.b(x)]


@pytest.mark.parametrize("estimator", lsn_ext.ESTIMATORS)
def test_list_output_gets_a_clear_error(estimator):
    x = torch.randn(2, 1, 3, 3)
    with pytest.raises(TypeError, match=r"returned a list of 2 outputs.*deep_supervision=False"):
        lsn_ext.ggn_diagonal(_TwoOutputs(), x, torch.zeros(2, 3, 3).long(), estimator=estimator)


def test_db_estimator_is_diag_backprop():
    model = tiny_unet(3)
    x, y = torch.randn(2, 2, 4, 4), torch.randint(0, 3, (2, 4, 4))
    got = lsn_ext.ggn_diagonal(model, x, y, "ce", estimator="db", ce_first_step="diag")
    want = lsn_ext.diag_backprop(model, x, y, "ce", ce_first_step="diag")
    torch.testing.assert_close(got.vector, want.vector, rtol=0, atol=0)
    assert got.scales is None


def _calibrated(model, x, y, loss, seed, **kwargs):
    return lsn_ext.ggn_diagonal(
        model,
        x,
        y,
        loss,
        estimator="db_calibrated",
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )


def test_calibrated_keeps_db_shape_with_monte_carlo_traces():
    model = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    got = _calibrated(model, x, y, "bce", seed=3, mc_samples=2)
    db = lsn_ext.diag_backprop(model, x, y, "bce").diagonals
    mc = lsn_ext.ggn_diagonal(
        model, x, y, "bce", estimator="mc", mc_samples=2, generator=torch.Generator().manual_seed(3)
    ).diagonals
    for k, d in got.diagonals.items():
        torch.testing.assert_close(d.sum(), mc[k].sum())
        torch.testing.assert_close(d, got.scales[k] * db[k])
        assert got.scales[k] > 0
    assert any(abs(c - 1) > 0.05 for c in got.scales.values())


def test_calibrated_shrinkage_interpolates_to_monte_carlo():
    model = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    full = _calibrated(model, x, y, "bce", seed=1, shrinkage=1.0).vector
    none = _calibrated(model, x, y, "bce", seed=1).vector
    half = _calibrated(model, x, y, "bce", seed=1, shrinkage=0.5).vector
    mc = lsn_ext.ggn_diagonal(
        model, x, y, "bce", estimator="mc", generator=torch.Generator().manual_seed(1)
    ).vector
    torch.testing.assert_close(full, mc)
    torch.testing.assert_close(half, (full + none) / 2)


@pytest.mark.slow
def test_calibrated_layer_traces_are_unbiased():
    model = tiny_unet(3)
    x, y = torch.randn(2, 2, 4, 4), torch.randint(0, 3, (2, 4, 4))
    exact = exact_ggn_diagonal(model, x, y, "ce")
    traces = torch.stack(
        [
            torch.stack([d.sum() for d in _calibrated(model, x, y, "ce", s).diagonals.values()])
            for s in range(200)
        ]
    )
    want = torch.stack([d.sum() for d in exact.values()])
    se = traces.std(0) / traces.shape[0] ** 0.5
    assert ((traces.mean(0) - want).abs() <= 5 * se).all()


def test_calibrated_uses_monte_carlo_where_db_sees_nothing():
    model = nn.Sequential(nn.Conv2d(1, 1, 1, bias=False), nn.Conv2d(1, 1, 1))
    with torch.no_grad():
        model[1].weight.zero_()  # no curvature reaches the first layer
    x, y = torch.randn(2, 1, 3, 3), torch.randn(2, 1, 3, 3)
    got = _calibrated(model, x, y, "mse", seed=0)
    assert torch.isnan(got.scales["0.weight"])
    assert got.diagonals["0.weight"].sum() == 0
    assert got.scales["1.bias"] > 0
    assert torch.isfinite(got.vector).all()


def test_mc_with_float32_and_a_generator_is_reproducible():
    model = tiny_unet(1).float()
    x, y = torch.randn(2, 2, 8, 8).float(), (torch.rand(2, 1, 8, 8) > 0.5).float()

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return lsn_ext.ggn_diagonal(model, x, y, "bce", estimator="mc", mc_samples=4, generator=g)

    a, b, c = run(0), run(0), run(1)
    assert a.vector.dtype == torch.float32
    torch.testing.assert_close(a.vector, b.vector, rtol=0, atol=0)
    assert not torch.equal(a.vector, c.vector)
    torch.testing.assert_close(a.loss, lsn_ext.diag_backprop(model, x, y, "bce").loss)


@pytest.mark.parametrize("estimator", ["mc", "db_calibrated"])
def test_model_is_left_as_found(estimator):
    model = tiny_unet(1)
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    lsn_ext.ggn_diagonal(model, x, y, "bce", estimator=estimator)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.training


def test_params_subset():
    model = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    chosen = [model.layers["head"].weight, model.layers["e1"].bias]
    got = lsn_ext.ggn_diagonal(model, x, y, "bce", estimator="mc", params=chosen)
    assert list(got.diagonals) == ["layers.e1.bias", "layers.head.weight"]


class _NonLeafParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.conv(x) * self.scale


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 1, 1)
        self.b = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        return nn.functional.conv2d(self.a(x), self.b.weight)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 1, 1)
        self.b = nn.Conv2d(1, 1, 1)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


class _TiedTwice(nn.Module):
    """A weight tied across three modules, one of them called twice, tanh in between."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.c = nn.Conv2d(2, 2, 1)
        self.b.weight = self.a.weight
        self.head = nn.Conv2d(2, 3, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) + self.c(h)
        return self.head(torch.tanh(self.b(h)))


@pytest.mark.parametrize("build", [_Tied, _TiedTwice], ids=["tied-pair", "tied-called-twice"])
def test_mc_sums_a_tied_weight_over_its_modules_before_squaring(build):
    """``b.weight = a.weight``: per-sample gradients of all modules and calls are summed first."""
    model = build().double()
    x = torch.randn(3, *((1, 3, 3) if build is _Tied else (2, 4, 4)), dtype=torch.float64)
    out_shape = model(x).shape
    loss = CrossEntropy() if out_shape[1] > 1 else MSE()
    y = _targets(loss, out_shape)
    noise = torch.randn(2, *out_shape, dtype=torch.float64)
    got = monte_carlo(model, x, y, loss, 2, None, None, noise).diagonals
    want = _dense_mc(model, x, y, loss, noise)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-9)


class _Folded(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x.reshape(-1, 3)).reshape(x.shape)


class _Kwargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Bilinear(2, 2, 2)

    def forward(self, x):
        return self.lin(x, x)


class _MixingModel(nn.Module):
    """A parameter of the model itself, and a forward that mixes the samples (batch centring)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = self.conv(x)
        return (h - h.mean(0, keepdim=True)) * self.scale


class _MixingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = self.conv(x)
        return h - h.mean(0, keepdim=True) * self.scale


# Per-module capture cannot serve these; the block or whole-model replay (torch.func) does.
FALLBACKS = {
    "non-leaf-parameter": (_NonLeafParameter, (2, 1, 3, 3), {"scale": "model"}),
    "functional-use": (_Functional, (2, 1, 3, 3), {"b.weight": "model", "a.weight": "module"}),
    "folded-batch": (_Folded, (2, 2, 3), {"lin.weight": "model", "lin.bias": "model"}),
    "two-inputs": (_Kwargs, (2, 2), {"lin.weight": "model"}),
    "block-with-own-parameter": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 1, 1), _NonLeafParameter(), nn.Tanh(), nn.Conv2d(1, 1, 1)
        ),
        (3, 1, 3, 3),
        {"1.scale": "block '1'", "1.conv.weight": "block '1'", "0.weight": "module"},
    ),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_mc_falls_back_to_block_or_whole_model_replay(name):
    """Equal to the dense per-sample reference with the same vectors, and says which path."""
    build, shape, paths = FALLBACKS[name]
    model = build()
    x = torch.randn(shape)
    out_shape = model(x).shape
    y = torch.randn(out_shape)
    noise = torch.randn(2, *out_shape)
    res = monte_carlo(model, x, y, MSE(), 2, None, None, noise)
    want = _dense_mc(model, x, y, MSE(), noise)
    for k in want:
        torch.testing.assert_close(res.diagonals[k], want[k], atol=1e-12, rtol=1e-9)
    for k, how in paths.items():
        assert res.mc_paths[k] == how, (k, res.mc_paths)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


ERRORS = {
    "model-mixes-samples": (_MixingModel, (2, 1, 3, 3), r"the model mixes the samples"),
    "block-mixes-samples": (
        lambda: nn.Sequential(_MixingBlock(), nn.Conv2d(1, 1, 1)),
        (2, 1, 3, 3),
        r"the block '0' \(_MixingBlock\) mixes the samples",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_mc_refuses_what_it_cannot_estimate(name):
    build, shape, match = ERRORS[name]
    model = build()
    x = torch.randn(shape)
    with pytest.raises(NotImplementedError, match=match):
        lsn_ext.ggn_diagonal(model, x, torch.randn(model(x).shape), "mse", estimator="mc")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_mc_refuses_training_mode_batch_norm():
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    x = torch.randn(3, 1, 2, 2)
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*eval"):
        lsn_ext.ggn_diagonal(model, x, torch.randn(3, 2, 2, 2), "mse", estimator="mc")


class _Checkpointed(nn.Module):
    """A checkpointed block (``reentrant`` True or False), or none (``None``)."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 1, 1)
        self.reentrant = reentrant

    def forward(self, x):
        def inner(t):
            return torch.tanh(self.conv(t))

        if self.reentrant is None:
            return self.head(inner(x))
        return self.head(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=self.reentrant))


def test_mc_refuses_reentrant_checkpoint_and_names_the_remedy():
    # torch's own message spoke of .grad() and an `inputs` argument the user never passed.
    model = _Checkpointed(reentrant=True).double()
    x, y = torch.randn(2, 2, 4, 4), torch.randn(2, 1, 4, 4)
    with pytest.raises(NotImplementedError, match=r"use_reentrant=True.*use_reentrant=False"):
        lsn_ext.ggn_diagonal(model, x, y, "mse", estimator="mc")
    remedy, plain = _Checkpointed(reentrant=False).double(), _Checkpointed(None).double()
    remedy.load_state_dict(model.state_dict())
    plain.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    got = lsn_ext.ggn_diagonal(remedy, x, y, "mse", mc_samples=4, generator=gen).diagonals
    gen = torch.Generator().manual_seed(0)
    want = lsn_ext.ggn_diagonal(plain, x, y, "mse", mc_samples=4, generator=gen).diagonals
    for name, d in want.items():
        assert d.abs().sum() > 0, name
        torch.testing.assert_close(got[name], d, rtol=1e-12, atol=0, msg=name)


def test_mc_explains_a_compiled_backward_that_donated_its_buffers(monkeypatch):
    # torch.compile's backward frees its saved tensors after one pass; torch's message speaks of
    # backward(retain_graph=...) calls the user never made. Its text, raised where torch raises it.
    real = torch.autograd.grad
    message = (
        "This backward function was compiled with non-empty donated buffers which requires "
        "create_graph=False and retain_graph=False."
    )

    def grad(outputs, inputs, *args, retain_graph=None, **kwargs):
        if retain_graph:
            raise RuntimeError(message)
        return real(outputs, inputs, *args, retain_graph=retain_graph, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.Tanh(), nn.Conv2d(2, 1, 1)).double()
    x = torch.randn(2, 1, 3, 3)
    with pytest.raises(NotImplementedError, match=r"torch.compile.*_orig_mod.*donated_buffer"):
        lsn_ext.ggn_diagonal(model, x, torch.randn(2, 1, 3, 3), "mse", mc_samples=2)


def test_mc_samples_beyond_memory_name_the_argument():
    # The allocator's own message named a byte count and nothing the caller passed.
    model = nn.Conv2d(1, 1, 1).double()
    x = torch.randn(2, 1, 3, 3)
    with pytest.raises(ValueError, match=r"mc_samples=1000000000000 needs .* GiB.*smaller mc_sa"):
        lsn_ext.ggn_diagonal(model, x, torch.randn(2, 1, 3, 3), "mse", mc_samples=10**12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"estimator": "exact"}, "unknown estimator 'exact'"),
        ({"estimator": "mc", "mc_samples": 0}, "mc_samples must be a positive int"),
        ({"estimator": "mc", "mc_samples": True}, "mc_samples must be a positive int"),
        ({"estimator": "db_calibrated", "shrinkage": 1.5}, r"shrinkage must lie in \[0, 1\]"),
        ({"estimator": "mc", "shrinkage": 0.5}, "shrinkage applies to"),
    ],
    ids=["unknown", "zero-samples", "bool-samples", "shrinkage-range", "shrinkage-not-calibrated"],
)
def test_argument_errors(kwargs, match):
    model = nn.Conv2d(1, 1, 1)
    x = torch.randn(2, 1, 2, 2)
    with pytest.raises(ValueError, match=match):
        lsn_ext.ggn_diagonal(model, x, torch.randn(2, 1, 2, 2), "mse", **kwargs)


# -- calls after the first skip the batch weight gradients -----------------------------------


def _assert_same_estimate(first, *later):
    """Every later result repeats the first one's diagonals bit for bit (all non-zero)."""
    for name, diag in first.diagonals.items():
        assert diag.abs().sum() > 0, name
        for result in later:
            assert torch.equal(result.diagonals[name], diag), name


def _records(model):
    """What the verified calls found for ``model``, per signature, fingerprint and structure."""
    known = planner._VERIFIED[model]
    return [plan for plans in known.values() for plan in plans.values()]


def _mc(model, x, y, seed):
    gen = torch.Generator().manual_seed(seed)
    return lsn_ext.ggn_diagonal(model, x, y, "bce", estimator="mc", mc_samples=2, generator=gen)


def test_calls_after_the_verified_one_give_the_same_estimate_without_batch_weight_grads():
    model = tiny_unet(1)
    x, y = torch.randn(2, 2, 8, 8), (torch.rand(2, 1, 8, 8) > 0.5).double()
    first = _mc(model, x, y, 0)  # verified: every draw against the batch weight gradients
    (record,) = _records(model)
    assert isinstance(record, Verified)
    assert record.captured == {n for n, _ in model.named_parameters()}
    second = _mc(model, x, y, 0)  # to the input only
    (again,) = _records(model)
    assert again is record
    _assert_same_estimate(first, second)


def test_calls_after_the_verified_one_square_alone_and_repeat_its_numbers(conv_kernel, monkeypatch):
    real, squared = Owner.sample_squares, []

    def counted(self, x, g, *out):
        squared.append(self.path)
        return real(self, x, g, *out)

    monkeypatch.setattr(Owner, "sample_squares", counted)
    conv = nn.Conv2d(4, 64, 3, padding=1)  # 2,304 weights per sample: stacked
    large = nn.Conv2d(64, 32, 3, padding=1)  # 18,432: accumulated per sample
    model = nn.Sequential(conv, nn.Tanh(), large, nn.Tanh(), nn.Conv2d(32, 1, 1)).double()
    x, y = torch.randn(3, 4, 6, 6), (torch.rand(3, 1, 6, 6) > 0.5).double()
    first = _mc(model, x, y, 0)
    assert squared == []  # the verified call keeps the per-sample gradients for its check
    second = _mc(model, x, y, 0)
    assert squared == ["4", "2", "0"] * 2  # two draws, in backward order
    _assert_same_estimate(first, second)


class _TiedTwice(nn.Module):
    """One convolution called twice: its per-sample gradients are summed over the calls."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 1, 1)

    def forward(self, x):
        return self.head(self.conv(torch.tanh(self.conv(x))))


def test_a_module_called_twice_sums_its_calls_before_squaring_after_the_verified_call(monkeypatch):
    real, squared = Owner.sample_squares, []

    def counted(self, x, g, *out):
        squared.append(self.path)
        return real(self, x, g, *out)

    monkeypatch.setattr(Owner, "sample_squares", counted)
    model = _TiedTwice().double()
    x, y = torch.randn(3, 2, 5, 5), (torch.rand(3, 1, 5, 5) > 0.5).double()
    noise = torch.randn(2, 3, 1, 5, 5, dtype=torch.double)
    first = monte_carlo(model, x, y, BCEWithLogits(), 2, None, None, noise)
    second = monte_carlo(model, x, y, BCEWithLogits(), 2, None, None, noise)
    assert squared == ["head", "head"]  # the twice-called conv is not squared per call
    want = _dense_mc(model, x, y, BCEWithLogits(), noise)
    for name in want:
        torch.testing.assert_close(first.diagonals[name], want[name], atol=1e-12, rtol=1e-9)
        torch.testing.assert_close(second.diagonals[name], want[name], atol=1e-12, rtol=1e-9)


def _spy_backward_ends(monkeypatch) -> list[list[tuple[int, ...]]]:
    """The shapes of what each of the estimator's backward passes asked gradients for."""
    ends, real = [], torch.autograd.grad

    def grad(outputs, inputs, *args, **kwargs):
        ends.append([tuple(t.shape) for t in inputs])
        return real(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    return ends


@pytest.mark.parametrize(
    ("act", "end"),
    [(nn.Tanh, (3, 4, 5, 5)), (lambda: nn.ReLU(inplace=True), (3, 2, 5, 5))],
    ids=["entry-output", "changed-in-place-so-input"],
)
def test_calls_after_the_verified_one_end_their_backward_pass_at_the_entry_modules(
    act, end, monkeypatch
):
    # At the first convolution's output, not the input; where an in-place activation changes
    # that output, autograd's pass to it would stop short of its hook: to the input, no rerun.
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), act(), nn.Conv2d(4, 1, 1)).double()
    x, y = torch.randn(3, 2, 5, 5), (torch.rand(3, 1, 5, 5) > 0.5).double()
    first = _mc(model, x, y, 0)
    ends = _spy_backward_ends(monkeypatch)
    second = _mc(model, x, y, 0)
    assert ends == [[end]] * 2
    assert _records(model)[0].entries
    _assert_same_estimate(first, second)


class _InputTwice(nn.Module):
    """The input reaches one convolution directly and another through a ReLU."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 1, 3, padding=1), nn.Conv2d(2, 1, 1)

    def forward(self, x):
        return self.a(x) + self.b(torch.relu(x))


def test_entries_that_miss_a_module_call_give_way_to_passes_to_the_input(monkeypatch):
    model = _InputTwice().double()
    x, y = torch.randn(3, 2, 5, 5), (torch.rand(3, 1, 5, 5) > 0.5).double()
    first = _mc(model, x, y, 0)
    ends = _spy_backward_ends(monkeypatch)
    second = _mc(model, x, y, 0)  # ends at a's output, misses b: redone to the input
    assert ends == [[(3, 1, 5, 5)], [(3, 2, 5, 5)], [(3, 2, 5, 5)]]
    record = _records(model)[0]
    assert record is not None
    assert not record.entries
    ends.clear()
    third = _mc(model, x, y, 0)
    assert ends == [[(3, 2, 5, 5)]] * 2  # straight to the input
    _assert_same_estimate(first, second, third)


class _ConstantBranch(nn.Module):
    """A head whose input does not depend on x: the backward pass to x never reaches it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bias_head = nn.Conv2d(2, 1, 3, padding=1), nn.Conv2d(2, 1, 1)

    def forward(self, x):
        return self.conv(x) + self.bias_head(torch.ones_like(x))


def test_a_capture_the_input_pass_cannot_reach_falls_back_to_verified_calls():
    model = _ConstantBranch().double()
    x, y = torch.randn(3, 2, 5, 5), (torch.rand(3, 1, 5, 5) > 0.5).double()
    first = _mc(model, x, y, 1)
    second = _mc(model, x, y, 1)  # the input pass misses bias_head: redone verified
    assert _records(model)[0] is None
    third = _mc(model, x, y, 1)
    for name, diag in first.diagonals.items():
        assert diag.abs().sum() > 0, name
        torch.testing.assert_close(second.diagonals[name], diag, msg=name)
        torch.testing.assert_close(third.diagonals[name], diag, msg=name)


class _SharedOnBuffer(nn.Module):
    """One convolution applied to x and to a buffer: the input pass reaches one of its calls."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 3, padding=1)
        self.register_buffer("c", torch.randn(3, 2, 5, 5))

    def forward(self, x):
        return self.conv(x) + self.conv(self.c)


def test_a_module_call_the_input_pass_cannot_reach_falls_back_to_verified_calls():
    # The captured parameters are the same either way (the call on x delivers them); only the
    # count of calls that arrived tells that the call on the buffer is missing.
    model = _SharedOnBuffer().double()
    x, y = torch.randn(3, 2, 5, 5), (torch.rand(3, 1, 5, 5) > 0.5).double()
    first = _mc(model, x, y, 1)
    (record,) = _records(model)
    assert record.fired == {("conv", 0), ("conv", 1)}
    second = _mc(model, x, y, 1)
    assert _records(model)[0] is None
    _assert_same_estimate(first, second)


DIRECT = {
    "conv1d-stride2": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), (5, 3, 9)),
    "conv2d-dilation-groups": (lambda: nn.Conv2d(4, 6, 3, dilation=2, groups=2), (3, 4, 7, 7)),
    "conv2d-no-bias": (lambda: nn.Conv2d(2, 3, 1, bias=False), (3, 2, 4, 5)),
    "conv2d-large-weight": (lambda: nn.Conv2d(64, 32, 3, padding=1), (3, 64, 4, 4)),
    "conv3d": (lambda: nn.Conv3d(2, 2, (1, 3, 3), padding=(0, 1, 1)), (2, 2, 3, 4, 4)),
    "linear-tokens": (lambda: nn.Linear(5, 3), (4, 6, 5)),
    "convT1d-stride2-outpad": (
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        (5, 3, 6),
    ),
    "convT2d-dilation-groups": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, dilation=2, groups=2),
        (3, 4, 5, 5),
    ),
    "convT2d-no-bias": (lambda: nn.ConvTranspose2d(2, 3, 2, stride=2, bias=False), (3, 2, 4, 5)),
    "convT3d": (lambda: nn.ConvTranspose3d(2, 3, (1, 2, 2), stride=(1, 2, 2)), (2, 2, 3, 2, 3)),
    "batchnorm2d-eval": (lambda: _randomised(nn.BatchNorm2d(3)).eval(), (4, 3, 5, 5)),
    "instancenorm2d-affine": (lambda: _randomised(nn.InstanceNorm2d(3, affine=True)), (4, 3, 5, 5)),
    "instancenorm3d-running-eval": (
        lambda: _randomised(nn.InstanceNorm3d(2, affine=True, track_running_stats=True)).eval(),
        (3, 2, 3, 4, 4),
    ),
    "groupnorm": (lambda: _randomised(nn.GroupNorm(2, 4)), (3, 4, 5, 3)),
    "layernorm-tokens": (lambda: _randomised(nn.LayerNorm(5)), (4, 6, 5)),
    "layernorm-2d-shape": (lambda: _randomised(nn.LayerNorm((3, 4))), (3, 2, 3, 4)),
}


def _randomised(module: nn.Module) -> nn.Module:
    """Random affine parameters and running statistics, so that neither is a neutral value."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.copy_(torch.randn_like(module.running_mean))
            module.running_var.copy_(torch.rand_like(module.running_var) + 0.5)
    return module


@pytest.fixture(params=["grouped", "per-sample"])
def conv_kernel(request, monkeypatch):
    """Which of the two convolution kernels serves (the CPU timing would choose one)."""
    monkeypatch.setattr(per_sample, "_LOOP_FASTER", {})
    monkeypatch.setattr(
        per_sample,
        "choose",
        lambda cache, key, a, b: cache.setdefault(key, request.param == "per-sample"),
    )
    return request.param


@pytest.mark.parametrize("case", DIRECT.values(), ids=DIRECT.keys())
@pytest.mark.parametrize("which", ["weight-and-bias", "bias-only"])
def test_direct_per_sample_gradients_equal_the_per_sample_jacobian(case, which, conv_kernel):
    make, shape = case
    module = make()
    x = torch.randn(shape)
    g = torch.randn_like(module(x))
    names = {n: n for n, _ in module.named_parameters() if which != "bias-only" or n == "bias"}
    got = direct_sample_grads(module, names, x, g)
    assert set(got) == set(names)
    if "conv" in type(module).__name__.lower() and names:  # the chosen kernel served
        assert list(per_sample._LOOP_FASTER.values()) == [conv_kernel == "per-sample"]
    for n in names:
        want = torch.stack(
            [
                torch.autograd.grad(module(x[i : i + 1]), getattr(module, n), g[i : i + 1])[0]
                for i in range(shape[0])
            ]
        )
        torch.testing.assert_close(got[n], want, msg=n)


@pytest.mark.parametrize("case", DIRECT.values(), ids=DIRECT.keys())
def test_direct_squared_gradients_are_the_squares_of_the_per_sample_gradients(case, conv_kernel):
    # Bit for bit: a call after the verified one squares this way (conv2d-large-weight: the
    # per-sample loop accumulates without stacking) and must repeat the verified call's numbers.
    make, shape = case
    module = make()
    x = torch.randn(shape)
    g = torch.randn_like(module(x))
    names = {n: n for n, _ in module.named_parameters()}
    stacked = direct_sample_grads(module, names, x, g)
    squared = direct_sample_grads(module, names, x, g, squared=True)
    assert set(squared) == set(names)
    for n in names:
        assert torch.equal(squared[n], square_sum(stacked[n].clone())), n
        torch.testing.assert_close(squared[n], stacked[n].square().sum(0), msg=n)


@pytest.mark.parametrize("shape", [(4, 3, 5), (4, 128, 130)], ids=["stacked", "accumulated"])
def test_square_sum_is_the_sum_of_squares_over_the_samples(shape):
    t = torch.randn(shape)
    assert (t[0].numel() >= per_sample._SQUARE_SUM_LOOP) is (shape[1] == 128)
    want = t.square().sum(0)
    torch.testing.assert_close(square_sum(t), want)


def test_square_sum_accumulates_sample_by_sample_on_cpu_only():
    # On a GPU, n launches would cost more than the second pass over memory they save.
    large = torch.Size([128, 130])
    assert per_sample._square_sum_loops(8, large, torch.device("cpu"))
    assert not per_sample._square_sum_loops(8, large, torch.device("meta"))
    assert not per_sample._square_sum_loops(1, large, torch.device("cpu"))
    assert not per_sample._square_sum_loops(8, torch.Size([3, 5]), torch.device("cpu"))


def test_deterministic_algorithms_keep_the_grouped_kernel(monkeypatch):
    monkeypatch.setattr(per_sample, "_LOOP_FASTER", {})
    monkeypatch.setattr(per_sample, "choose", lambda cache, key, a, b: cache.setdefault(key, True))
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(4, 2, 5, 5)
    g = torch.randn(4, 3, 5, 5)
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = direct_sample_grads(conv, {"weight": "weight"}, x, g)
    finally:
        torch.use_deterministic_algorithms(mode)
    assert per_sample._LOOP_FASTER == {}  # nothing timed, the grouped kernel served
    want = torch.stack(
        [torch.autograd.grad(conv(x[i : i + 1]), conv.weight, g[i : i + 1])[0] for i in range(4)]
    )
    torch.testing.assert_close(got["weight"], want)


def test_direct_gradients_leave_other_modules_to_the_replay():
    conv = nn.Conv2d(2, 2, 3, padding="same")
    x = torch.randn(2, 2, 4, 4)
    assert direct_sample_grads(conv, {"weight": "weight"}, x, conv(x)) is None
    conv = nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")
    assert direct_sample_grads(conv, {"weight": "weight"}, x, conv(x)) is None
    conv = nn.Conv2d(2, 2, 3, padding=1)
    conv.forward = lambda t: 2 * nn.Conv2d.forward(conv, t)
    assert direct_sample_grads(conv, {"weight": "weight"}, x, conv(x)) is None
    norm = nn.BatchNorm2d(2)  # training mode: batch statistics couple the samples
    assert direct_sample_grads(norm, {"weight": "weight"}, x, x) is None
    norm = nn.InstanceNorm2d(2, affine=True)  # an input without batch dim
    assert direct_sample_grads(norm, {"weight": "weight"}, x[0], x[0]) is None
    norm = nn.LayerNorm((2, 4, 4))
    assert direct_sample_grads(norm, {"weight": "weight"}, x[0], x[0]) is None


def test_direct_transposed_convolution_gradients_follow_the_calls_output_size():
    conv = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    x = torch.randn(3, 2, 4, 4)
    size = (8, 8)  # output_padding 1, set by the call
    g = torch.randn_like(conv(x, output_size=size))
    got = direct_sample_grads(conv, {"weight": "weight", "bias": "bias"}, x, g)
    for n in ("weight", "bias"):
        want = torch.stack(
            [
                torch.autograd.grad(
                    conv(x[i : i + 1], output_size=size), getattr(conv, n), g[i : i + 1]
                )[0]
                for i in range(3)
            ]
        )
        torch.testing.assert_close(got[n], want, msg=n)


class _AddBias(nn.Module):
    """``y = x + b`` with ``b`` shaped like one sample: replayed per sample, its ``vjp`` for
    ``b`` is the output gradient itself (no copy)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.b = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


class _TwoHeads(nn.Module):
    """Two replayed heads on one tensor, summed: both receive the same output gradient."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 3, padding=1)
        self.head1, self.head2 = _AddBias((1, 1, 4, 4)), _AddBias((1, 1, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        return self.head1(z) + self.head2(z)


class _TwoNorms(nn.Module):
    """Two layer norms over all of a sample: their per-sample bias gradients are ``g`` itself."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 3, padding=1)
        self.norm1, self.norm2 = nn.LayerNorm((1, 4, 4)), nn.LayerNorm((1, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        return self.norm1(z) + self.norm2(z)


@pytest.mark.parametrize(
    "model",
    [_TwoHeads, lambda: _AddBias((1, 2, 4, 4)), _TwoNorms],
    ids=["shared", "last", "shared-layernorm"],
)
def test_replayed_gradients_that_alias_the_output_gradient_are_squared_once(model):
    """Per-sample gradients are squared in place; a replay's alias of ``g`` must be copied
    first, or one head's squares would overwrite the other's (or the vectors)."""
    torch.manual_seed(0)
    net = model().double()
    x = torch.randn(3, 2, 4, 4)
    y = (torch.rand_like(net(x)) > 0.5).double()
    noise = torch.randn(2, *net(x).shape, generator=torch.Generator().manual_seed(1))
    capture = monte_carlo(net, x, y, BCEWithLogits(), 2, None, None, noise.clone())
    whole = monte_carlo(net, x, y, BCEWithLogits(), 2, None, None, noise.clone(), _force="model")
    assert set(capture.mc_paths.values()) == {"module"}
    for k, d in capture.diagonals.items():
        torch.testing.assert_close(d, whole.diagonals[k], rtol=1e-9, atol=1e-14, msg=k)
    vectors = BCEWithLogits().hessian_sqrt(net(x).detach(), y, noise)
    for name in [n for n in capture.diagonals if n.endswith("b")]:  # J = I: Σ_s Σ_n s_n² / S
        want = vectors.square().sum(1).mean(0)
        torch.testing.assert_close(capture.diagonals[name], want.reshape_as(whole.diagonals[name]))
