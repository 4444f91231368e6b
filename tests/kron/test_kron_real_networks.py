"""``kron_curvature`` on the MONAI and nnU-Net networks of tests/real_networks.py (2-D and 3-D)."""

import pytest
import torch

from lsn_ext.kron import init_kron, kron_curvature
from tests.real_networks import REAL_NETWORKS


@pytest.mark.parametrize("case", list(REAL_NETWORKS))
def test_every_parameter_gets_a_finite_psd_block_in_laplace_torch_layout(case):
    spec = REAL_NETWORKS[case]
    reason = spec.available()
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    net = spec.build().double()
    x, y = spec.batch()
    gen = torch.Generator().manual_seed(0)
    result = kron_curvature(net, x, y, spec.loss, mc_samples=2, generator=gen)
    params = [p for p in net.parameters() if p.requires_grad]
    layout = init_kron(params, torch.device("cpu"), torch.float64)
    assert len(result.kron.kfacs) == len(params)
    for name, entry, zero in zip(result.names, result.kron.kfacs, layout.kfacs, strict=True):
        assert [t.shape for t in entry] == [t.shape for t in zero], name
        for F in entry:
            assert bool(torch.isfinite(F).all()), name
            torch.testing.assert_close(F, F.T, msg=name)
            low = float(torch.linalg.eigvalsh(F).min())
            assert low >= -1e-10 * max(float(F.diagonal().abs().max()), 1e-300), name
    assert "kfac" in result.blocks.values()
    assert set(result.paths.values()) <= {"layer", "per-sample", "batch gradient", "unused"}


def test_monai_unetr_attention_and_position_embeddings():
    """A transformer U-Net: Linear projections are KFAC layers, the position embeddings (held
    by a module with children) and the unused cross-attention norms get blocks too."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    net = nets.UNETR(
        in_channels=1, out_channels=2, img_size=(16, 16), feature_size=4, hidden_size=24,
        mlp_dim=32, num_heads=2, spatial_dims=2,
    ).eval().double()  # fmt: skip
    x, y = torch.randn(2, 1, 16, 16), torch.randint(0, 2, (2, 16, 16))
    result = kron_curvature(net, x, y, "ce")
    qkv = "vit.blocks.0.attn.qkv.weight"
    assert (result.blocks[qkv], result.paths[qkv]) == ("kfac", "layer")
    pos = "vit.patch_embedding.position_embeddings"
    assert (result.blocks[pos], result.paths[pos]) == ("nearest kron", "batch gradient")
    assert [t.shape for t in result.factors(pos)] == [(1, 1), (24, 24)]  # [1, 1, 24]
    unused = "vit.blocks.0.norm_cross_attn.weight"
    assert result.paths[unused] == "unused"
    assert not result.factors(unused)[0].any()
    assert result.paths["vit.blocks.0.norm1.weight"] == "per-sample"


def _dense(entry: list[torch.Tensor]) -> torch.Tensor:
    return torch.kron(*entry) if len(entry) == 2 else entry[0]


@pytest.mark.parametrize("case", list(REAL_NETWORKS))
def test_float32_agrees_with_float64(case):
    """Same draws in float32: same paths, no false alarm of the gradient checks (a conv bias
    before a norm layer has a gradient of rounding size), blocks within float32 rounding."""
    spec = REAL_NETWORKS[case]
    reason = spec.available()
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    net = spec.build().float()
    x, y = spec.batch()
    results = {}
    for dtype in (torch.float32, torch.float64):
        net.to(dtype)
        target = y if spec.classes > 1 else y.to(dtype)
        gen = torch.Generator().manual_seed(0)
        results[dtype] = kron_curvature(net, x.to(dtype), target, spec.loss, generator=gen)
    single, double = results[torch.float32], results[torch.float64]
    assert single.paths == double.paths
    num = sum(
        float((_dense(single.factors(n)).double() - _dense(double.factors(n))).norm() ** 2)
        for n in double.names
    )
    den = sum(float(_dense(double.factors(n)).norm() ** 2) for n in double.names)
    assert (num / den) ** 0.5 < 1e-5
