"""Lanczos eigenpairs, the trace estimate and the rank rule against ``torch.linalg.eigh``.

The dense GGN of small networks (``tests.lowrank.dense``) is the reference: eigenvalues, the
subspace of the eigenvectors (via ``U Λ Uᵀ``, independent of signs and of rotations within
repeated eigenvalues), the exact trace, and the rank the rule must choose.
"""

from __future__ import annotations

import pytest
import torch

from lsn_ext.lowrank import choose_rank, deflated_trace, lanczos, lowrank_ggn
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy
from tests.lowrank.dense import dense_ggn
from tests.lowrank.test_products import Net3d, _batches
from tests.networks import tiny_unet

NETS = {
    "unet-2d-ce": (lambda: tiny_unet(2), (2, 8, 8), 2, CrossEntropy()),
    "unet-2d-bce": (lambda: tiny_unet(1), (2, 8, 8), 1, BCEWithLogits()),
    "net-3d-ce": (Net3d, (1, 4, 4, 4), 2, CrossEntropy()),
}


def _setting(name):
    build, shape, classes, loss = NETS[name]
    torch.manual_seed(0)
    model = build().eval()
    batches = _batches(shape, classes, loss)
    return model, batches, loss, dense_ggn(model, batches, loss)


@pytest.mark.parametrize("name", NETS, ids=str)
def test_top_eigenpairs_match_eigh_of_the_dense_ggn(name):
    model, batches, loss, G = _setting(name)
    k = 5
    gen = torch.Generator().manual_seed(0)
    result = lowrank_ggn(model, batches, loss, rank=k, steps=40, generator=gen)
    values, vectors = torch.linalg.eigh(G)
    values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
    torch.testing.assert_close(result.eigenvalues, values, rtol=1e-9, atol=0)
    U = result.eigenvectors
    torch.testing.assert_close(U.T @ U, torch.eye(k))
    torch.testing.assert_close((U * result.eigenvalues) @ U.T, (vectors * values) @ vectors.T)
    assert float(result.residuals.max()) < 1e-6 * float(values[0])
    assert result.steps == 40
    torch.testing.assert_close(result.loss, sum(loss.value(model(x), y) for x, y in batches))


@pytest.mark.parametrize("name", NETS, ids=str)
def test_default_steps_give_eigenvalues_within_their_reported_residuals(name):
    # For a symmetric G, some eigenvalue lies within ‖G u − θ u‖ of each Ritz value θ.
    model, batches, loss, G = _setting(name)
    result = lowrank_ggn(model, batches, loss, rank=5, generator=torch.Generator().manual_seed(0))
    assert result.steps == 2 * 5 + 10
    values = torch.linalg.eigvalsh(G).flip(0)[:5]
    assert bool(((result.eigenvalues - values).abs() <= result.residuals + 1e-9).all())
    torch.testing.assert_close(result.eigenvalues, values, rtol=1e-3, atol=0)


def test_lanczos_on_a_matrix_with_known_spectrum():
    gen = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(200, 200, generator=gen))
    spectrum = 2.0 ** -torch.arange(200.0)
    A = (Q * spectrum) @ Q.T
    result = lanczos(lambda v: A @ v, 200, 40, generator=gen)
    torch.testing.assert_close(result.eigenvalues[:8], spectrum[:8], rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(result.basis.T @ result.basis, torch.eye(40), atol=1e-12, rtol=0)


def test_invariant_krylov_space_stops_early_and_drops_zero_eigenvalues():
    # A rank-3 operator: after 4 steps the Krylov space is invariant.
    gen = torch.Generator().manual_seed(2)
    V, _ = torch.linalg.qr(torch.randn(50, 3, generator=gen))
    A = (V * torch.tensor([5.0, 2.0, 1.0])) @ V.T
    result = lanczos(lambda v: A @ v, 50, 20, generator=gen)
    assert result.steps == 4
    torch.testing.assert_close(result.eigenvalues[:3], torch.tensor([5.0, 2.0, 1.0]))
    assert abs(float(result.eigenvalues[3])) < 1e-12


def test_fewer_pairs_than_rank_where_the_ggn_has_fewer_outputs():
    # One image of 4×4 with one BCE logit: the GGN has rank ≤ 16.
    torch.manual_seed(0)
    model = tiny_unet(1).eval()
    batches = _batches((2, 4, 4), 1, BCEWithLogits(), n=1, batch=1)
    G = dense_ggn(model, batches, BCEWithLogits())
    result = lowrank_ggn(model, batches, BCEWithLogits(), rank=30, steps=40)
    assert result.rank == int(torch.linalg.matrix_rank(G)) == 16
    torch.testing.assert_close(result.eigenvalues, torch.linalg.eigvalsh(G).flip(0)[:16])


def test_float32_resolves_a_rank_deficient_ggn_to_its_round_off():
    # The same 16-output GGN in float32: 16 pairs above round-off, matching float64's.
    torch.manual_seed(0)
    model = tiny_unet(1).eval()
    batches = _batches((2, 4, 4), 1, BCEWithLogits(), n=1, batch=1)
    G = dense_ggn(model, batches, BCEWithLogits())
    model32 = model.float()
    batches32 = [(x.float(), y.float()) for x, y in batches]
    result = lowrank_ggn(model32, batches32, BCEWithLogits(), rank=30, steps=40)
    assert result.eigenvalues.dtype == torch.float32
    assert result.rank == 16
    expected = torch.linalg.eigvalsh(G).flip(0)[:16].float()
    torch.testing.assert_close(
        result.eigenvalues, expected, rtol=1e-3, atol=1e-5 * float(expected[0])
    )


def test_deflated_trace_is_unbiased_and_its_error_is_honest():
    model, batches, loss, G = _setting("unet-2d-ce")
    from lsn_ext.lowrank import GGNOperator

    op = GGNOperator(model, batches, loss)
    result = lanczos(op.matvec, op.dim, 10, generator=torch.Generator().manual_seed(0))
    estimate = deflated_trace(op.matvec, result, 30, torch.Generator().manual_seed(1))
    exact = float(G.trace())
    assert estimate.krylov == pytest.approx(float(result.diagonal.sum()))
    assert estimate.krylov < exact
    assert estimate.standard_error > 0
    assert abs(estimate.value - exact) < 4 * estimate.standard_error
    # Deflation helps: the plain Hutchinson error with as many probes would be larger.
    plain = torch.linalg.eigvalsh(G)
    assert estimate.standard_error < (2 * plain.square().sum() / 30).sqrt()


def test_rank_rule_picks_the_smallest_rank_reaching_the_energy():
    model, batches, loss, G = _setting("unet-2d-ce")
    result = lowrank_ggn(model, batches, loss, rank=60, energy=0.8, trace_probes=20)
    values = torch.linalg.eigvalsh(G).flip(0)
    expected = int((values.cumsum(0) >= 0.8 * result.trace.value).nonzero()[0]) + 1
    assert result.rank == expected
    assert result.captured >= 0.8
    assert float(values[: result.rank - 1].sum()) < 0.8 * result.trace.value


def test_choose_rank_returns_all_when_the_energy_is_not_reached():
    values = torch.tensor([4.0, 2.0, 1.0])
    assert choose_rank(values, 7.0, 0.5) == 1
    assert choose_rank(values, 7.0, 0.8) == 2
    assert choose_rank(values, 100.0, 0.5) == 3


def test_too_few_steps_warn_about_unconverged_pairs():
    model, batches, loss, _ = _setting("unet-2d-ce")
    with pytest.warns(RuntimeWarning, match=r"Lanczos residuals above tol=1e-06 .*\(steps=20\)"):
        lowrank_ggn(model, batches, loss, rank=8, steps=10, tol=1e-6)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rank": 0}, "rank must be an int ≥ 1"),
        ({"rank": 2.5}, "rank must be an int ≥ 1"),
        ({"rank": 10**7}, r"exceeds the number of trainable parameters"),
        ({"energy": 1.5}, r"energy must be None or a fraction in \(0, 1\]"),
        ({"steps": 3, "rank": 5}, "steps must be None or an int ≥ rank=5"),
        ({"trace_probes": -1}, "trace_probes must be an int ≥ 0"),
        ({"tol": 0}, "tol must be a positive number"),
    ],
    ids=["rank-0", "rank-float", "rank-too-large", "energy", "steps", "probes", "tol"],
)
def test_bad_options_are_refused(options, match):
    model, batches, loss, _ = _setting("unet-2d-bce")
    with pytest.raises(ValueError, match=match):
        lowrank_ggn(model, batches, loss, **options)


def test_zero_curvature_is_refused():
    torch.manual_seed(0)
    model = tiny_unet(2).eval()
    x, y = _batches((2, 8, 8), 2, CrossEntropy(), n=1)[0]
    y[:] = -100  # every position ignored
    with pytest.raises(ValueError, match="zero curvature"):
        lowrank_ggn(model, [(x, y)], CrossEntropy(), rank=2)
