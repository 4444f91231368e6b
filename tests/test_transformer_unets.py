"""Monte Carlo where per-module capture cannot serve: transformer U-Nets and their kin.

MONAI's ``UNETR`` holds its position embeddings in a module with submodules; ``SwinUNETR`` holds
relative-position bias tables there too, and its window attention folds the windows into dim 0.
A ``weight_norm`` parametrization and an instance-level ``forward`` override are the small
cases. For these the Monte-Carlo estimator replays the smallest enclosing block that is called
on the batch (or the whole model) per sample with ``torch.func``; here it is unbiased against the
exact GGN diagonal (float64, z-tests over replicates of per-tensor traces), gives the same
numbers as the whole-model replay and, with the same vectors, as the ordinary capture on a plain
U-Net, works under non-reentrant checkpointing and in the laplace-torch workflow, and leaves the
model as found. DB keeps refusing the weight-norm and override models.

The losses are masked (BCE element weights, cross-entropy ``ignore_index``) to a few pixels per
image: every parameter still sees curvature, and the exact reference stays cheap.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from laplace import Laplace
from torch import Tensor, nn

import lsn_ext
from lsn_ext.estimators.monte_carlo import monte_carlo
from lsn_ext.exact import exact_ggn_diagonal
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy, Loss
from tests.engine.test_no_silent_path import _batch, _Checkpointed, _overridden, _weight_normed
from tests.model_state import assert_unchanged, snapshot
from tests.networks import tiny_unet

pytest.importorskip("monai")
pytestmark = pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`")

KEPT = 24  # pixels per image that enter the loss


def _unetr(spatial_dims: int, classes: int, size: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks.nets import UNETR

        return UNETR(
            in_channels=1, out_channels=classes, img_size=(size,) * spatial_dims, feature_size=2,
            hidden_size=8, mlp_dim=8, num_heads=2, spatial_dims=spatial_dims,
        ).eval()  # fmt: skip

    return build


def _swin(spatial_dims: int, classes: int, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks.nets import SwinUNETR

        # Batch norm in the convolutional decoder: at the smallest input (32 per side) the
        # bottleneck is 1 pixel, where the default instance norm cannot run.
        return SwinUNETR(
            in_channels=1, out_channels=classes, feature_size=12, depths=(2, 1, 1, 1),
            num_heads=(1, 1, 1, 1), window_size=4, spatial_dims=spatial_dims,
            norm_name="batch", **kwargs,
        ).eval()  # fmt: skip

    return build


def _masked_batch(
    shape: tuple[int, ...], classes: int, seed: int = 0
) -> tuple[Tensor, Tensor, Loss]:
    """Inputs ``[2, *shape]``, targets and a loss that counts ``KEPT`` pixels per image."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, *shape, generator=gen)
    spatial = shape[1:]
    keep = torch.zeros(2, *spatial, dtype=torch.bool)
    for n in range(2):
        keep.view(2, -1)[n, torch.randperm(keep[0].numel(), generator=gen)[:KEPT]] = True
    if classes == 1:
        y = (torch.rand(2, 1, *spatial, generator=gen) > 0.7).double()
        return x, y, BCEWithLogits(weight=keep.unsqueeze(1).double())
    y = torch.randint(0, classes, (2, *spatial), generator=gen)
    y[~keep] = 255
    return x, y, CrossEntropy(ignore_index=255)


NETWORKS = {
    "unetr-2d-bce": (_unetr(2, 1, 32), (1, 32, 32), 1),
    "unetr-2d-ce": (_unetr(2, 3, 32), (1, 32, 32), 3),
    "unetr-3d-bce": (_unetr(3, 1, 16), (1, 16, 16, 16), 1),
    "swinunetr-2d-bce": (_swin(2, 1), (1, 32, 32), 1),
    "swinunetr-2d-ce": (_swin(2, 2), (1, 32, 32), 2),
}
REPLICATES, DRAWS = 24, 4
POSITION = "vit.patch_embedding.position_embeddings"


@functools.cache
def _setting(name: str):
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        build, shape, classes = NETWORKS[name]
        torch.manual_seed(0)
        model = build().double()
        x, y, loss = _masked_batch(shape, classes)
        exact = exact_ggn_diagonal(model, x, y, loss)
    finally:
        torch.set_default_dtype(dtype)
    return model, x, y, loss, exact


def _z_scores(model, x, y, loss, exact, replicates=REPLICATES, draws=DRAWS, **kwargs):
    """z of each tensor's trace (and of the total) over replicates of ``draws``-draw estimates."""
    traces = []
    for r in range(replicates):
        res = monte_carlo(
            model, x, y, loss, draws, torch.Generator().manual_seed(r), None, **kwargs
        )
        traces.append(torch.stack([res.diagonals[k].sum() for k in exact]))
    t = torch.stack(traces)  # [replicates, tensors]
    want = torch.stack([e.sum() for e in exact.values()])
    top = float(want.max())
    se = t.std(0) / replicates**0.5
    live = se > 1e-10 * top
    assert torch.allclose(t[:, ~live].mean(0), want[~live], atol=1e-8 * top), "a zero tensor"
    z = (t.mean(0) - want)[live] / se[live]
    total = t.sum(1)
    z_total = (total.mean() - want.sum()) / (total.std() / replicates**0.5)
    return z, float(z_total), res


@pytest.mark.slow
@pytest.mark.parametrize("name", NETWORKS)
def test_monte_carlo_is_unbiased_on_transformer_unets(name):
    model, x, y, loss, exact = _setting(name)
    before = snapshot(model)
    z, z_total, last = _z_scores(model, x, y, loss, exact)
    assert_unchanged(model, before)
    print(f"{name}: {z.numel()} tensors, max |z| {z.abs().max():.2f}, mean z {z.mean():+.2f}")
    assert z.abs().max() < 5, (name, z)
    assert abs(z_total) < 5
    blocks = {p for p in last.mc_paths.values() if p.startswith("block")}
    if name.startswith("unetr"):
        assert blocks == {"block 'vit.patch_embedding'"}
        assert last.mc_paths[POSITION] in blocks
    else:  # every Swin stage is replayed whole: its attention folds windows into dim 0
        assert blocks == {f"block 'swinViT.layers{i}.0'" for i in range(1, 5)}
        bias = "swinViT.layers1.0.blocks.0.attn.relative_position_bias_table"
        assert last.mc_paths[bias] == "block 'swinViT.layers1.0'"
    assert last.mc_paths["out.conv.conv.weight"] == "module"


@pytest.mark.parametrize(
    "name", ["unetr-2d-ce", pytest.param("swinunetr-2d-bce", marks=pytest.mark.slow)]
)
def test_block_replay_equals_whole_model_replay(name):
    """Same vectors, same numbers: the per-block and the whole-model path agree."""
    model, x, y, loss, _ = _setting(name)
    noise = torch.randn(2, *model(x).shape, generator=torch.Generator().manual_seed(1))
    blocks = monte_carlo(model, x, y, loss, 2, None, None, noise)
    whole = monte_carlo(model, x, y, loss, 2, None, None, noise, _force="model")
    assert set(whole.mc_paths.values()) == {"model"}
    for k, d in blocks.diagonals.items():
        torch.testing.assert_close(d, whole.diagonals[k], rtol=1e-9, atol=1e-14, msg=k)


def test_swinunetr_with_non_reentrant_checkpointing_gives_the_same_estimate():
    """MONAI's ``use_checkpoint=True`` (non-reentrant) on and off: the same estimate."""
    torch.manual_seed(0)
    plain = _swin(2, 1)().double()
    checkpointed = _swin(2, 1, use_checkpoint=True)().double()
    checkpointed.load_state_dict(plain.state_dict())
    x, y, loss = _masked_batch((1, 32, 32), 1)
    noise = torch.randn(1, *plain(x).shape, generator=torch.Generator().manual_seed(2))
    before = snapshot(checkpointed)
    a = monte_carlo(plain, x, y, loss, 1, None, None, noise)
    b = monte_carlo(checkpointed, x, y, loss, 1, None, None, noise)
    assert_unchanged(checkpointed, before)
    assert a.mc_paths == b.mc_paths
    for k, d in a.diagonals.items():
        torch.testing.assert_close(b.diagonals[k], d, rtol=1e-9, atol=1e-14, msg=k)
    assert all(bool(torch.isfinite(d).all()) for d in a.diagonals.values())


def test_whole_model_path_under_non_reentrant_checkpointing():
    net = _Checkpointed(False).eval()
    x, y = _batch()
    noise = torch.randn(2, 2, 2, 5, 5)
    whole = monte_carlo(net, x, y, CrossEntropy(), 2, None, None, noise, _force="model")
    capture = monte_carlo(net, x, y, CrossEntropy(), 2, None, None, noise)
    assert set(capture.mc_paths.values()) == {"module"}
    torch.testing.assert_close(whole.vector, capture.vector, rtol=1e-9, atol=1e-14)


def test_whole_model_fallback_equals_capture_on_a_plain_unet():
    """Forced through the whole model, a plain U-Net gives the capture's numbers (same vectors)
    and is unbiased against the exact diagonal."""
    model = tiny_unet(3, up="bilinear")
    x = torch.randn(2, 2, 8, 8)
    y = torch.randint(0, 3, (2, 8, 8))
    loss = CrossEntropy()
    noise = torch.randn(3, 2, 3, 8, 8)
    capture = monte_carlo(model, x, y, loss, 3, None, None, noise)
    whole = monte_carlo(model, x, y, loss, 3, None, None, noise, _force="model")
    assert set(capture.mc_paths.values()) == {"module"}
    assert set(whole.mc_paths.values()) == {"model"}
    torch.testing.assert_close(whole.vector, capture.vector, rtol=1e-9, atol=1e-14)
    exact = exact_ggn_diagonal(model, x, y, loss)
    z, z_total, _ = _z_scores(model, x, y, loss, exact, replicates=60, draws=2, _force="model")
    print(f"tiny-unet forced whole-model: max |z| {z.abs().max():.2f}, mean z {z.mean():+.2f}")
    assert z.abs().max() < 5
    assert abs(z_total) < 5


SMALL = {
    "weight-norm-conv": (lambda: _weight_normed(False), "block '0'"),
    "instance-forward-override": (_overridden, "module"),
}


@pytest.mark.parametrize("name", SMALL)
def test_monte_carlo_is_unbiased_where_db_refuses(name):
    build, how = SMALL[name]
    net = build().eval()
    x, y = _batch()
    with pytest.raises(NotImplementedError, match=r"'0' \((Parametrized)?Conv2d\) has"):
        lsn_ext.diag_backprop(net, x, y, "ce")
    exact = exact_ggn_diagonal(net, x, y, "ce")
    before = snapshot(net)
    z, z_total, last = _z_scores(net, x, y, CrossEntropy(), exact, replicates=100, draws=2)
    assert_unchanged(net, before)
    print(f"{name}: max |z| {z.abs().max():.2f}, mean z {z.mean():+.2f}")
    assert z.abs().max() < 5
    assert abs(z_total) < 5
    assert {last.mc_paths[k] for k in exact if k.startswith("0.")} == {how}


def test_laplace_workflow_on_unetr():
    torch.manual_seed(0)
    model = _unetr(2, 2, 32)().double()
    x = torch.randn(4, 1, 32, 32)
    y = torch.randint(0, 2, (4, 32, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs={"estimator": "mc"},
    )
    la.fit(loader)
    assert la.H.shape == (sum(p.numel() for p in model.parameters()),)
    assert torch.isfinite(la.H).all()
    assert (la.H >= 0).all()
    sizes = {k: p.numel() for k, p in model.named_parameters()}
    start = sum(sizes[k] for k in list(sizes)[: list(sizes).index(POSITION)])
    assert la.H[start : start + sizes[POSITION]].sum() > 0
    pred = lsn_ext.predict(la, x[:2], n_samples=3, generator=torch.Generator().manual_seed(0))
    assert pred.mean.shape == (2, 2, 32, 32)
    assert torch.isfinite(pred.mean).all()
    assert (pred.variance >= 0).all()
