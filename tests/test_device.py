"""Device-agnostic code paths, checked on the CPU.

Per-batch Monte-Carlo seeds (the CPU keeps hashing the batch's bytes; accelerators use
:func:`lsn_ext.laplace_ext.digest.batch_digest`, computed on the device), the curvature checks that
synchronise once per batch instead of once per parameter, and the box corruptions. The CUDA runs
are in ``tests/test_gpu.py``.
"""

import hashlib

import pytest
import torch

from lsn_ext.engine import (
    all_finite,
    check_db_diagonals,
    check_finite_result,
    round_off,
    sum_tolerance,
)
from lsn_ext.laplace_ext import digest as digest_module
from lsn_ext.laplace_ext.backend import DiagBackprop
from lsn_ext.laplace_ext.digest import batch_digest
from lsn_ext.metrics import black_box, noise_box, sample_boxes
from lsn_ext.models import UNet

PRIMES = [p for p, _, _ in digest_module.DIGEST_LCGS]


def test_cpu_batch_seed_is_the_hash_of_the_batch_bytes():
    """On the CPU the seed is what it always was: blake2b of (seed, shapes, dtypes, bytes)."""
    backend = DiagBackprop(UNet(3, 1, widths=(2, 3, 4)), "classification", loss="bce", seed=5)
    x = torch.randn(2, 16, 16, 3).permute(0, 3, 1, 2)  # not contiguous: its values are hashed
    y = (torch.rand(2, 1, 16, 16) > 0.5).double()
    digest = hashlib.blake2b(b"5", digest_size=8)
    for t in (x, y):
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.contiguous().numpy().tobytes())
    expected = int.from_bytes(digest.digest(), "little") & (2**63 - 1)
    generator = backend._batch_generator(x, y)
    assert generator.device.type == "cpu"
    assert generator.initial_seed() == expected


def test_fingerprint_is_exact_and_tells_batches_apart(monkeypatch):
    x = torch.randn(3, 5, 7)
    fp = batch_digest(x)
    assert fp.dtype == torch.int64
    assert fp.shape == (2,)
    assert all(0 <= int(v) < p for v, p in zip(fp, PRIMES, strict=True))
    assert torch.equal(batch_digest(x.clone()), fp)
    # the values in logical order, whatever the memory layout
    assert torch.equal(batch_digest(x.transpose(0, 2).contiguous().transpose(0, 2)), fp)
    # integer sums: chunking (the reduction order) does not change the result
    monkeypatch.setattr(digest_module, "DIGEST_LCGS_CHUNK", 4)
    assert torch.equal(batch_digest(x), fp)
    monkeypatch.undo()
    ulp = x.clone()
    ulp[1, 2, 3] = torch.nextafter(ulp[1, 2, 3], torch.tensor(10.0))
    swapped = x.clone()
    swapped[0, 0, [0, 1]] = swapped[0, 0, [1, 0]]
    for other in (ulp, swapped, x.float(), x[:2]):
        assert not torch.equal(batch_digest(other), fp)


def test_fingerprint_words_that_agree_modulo_one_prime_differ_modulo_the_other():
    a = torch.tensor([7, -1], dtype=torch.int32)
    b = torch.tensor([7, -1 + PRIMES[0]], dtype=torch.int32)
    fa, fb = batch_digest(a), batch_digest(b)
    assert fa[0] == fb[0]
    assert fa[1] != fb[1]


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.float16, torch.bfloat16, torch.int64, torch.complex128],
)
def test_fingerprint_of_every_dtype(dtype):
    t = (torch.rand(4, 9) * 5).to(dtype)
    fp = batch_digest(t)
    assert all(0 <= int(v) < p for v, p in zip(fp, PRIMES, strict=True))
    assert torch.equal(batch_digest(t.clone()), fp)
    assert batch_digest(t[:0]).tolist() == [0, 0]


def test_curvature_checks_name_the_first_bad_parameter():
    ok = torch.ones(3)
    check_finite_result({"a": ok, "b": torch.zeros(0), "c": ok}, torch.float64, "DB")
    bad = torch.tensor([1.0, torch.inf])
    diagonals = {"a": ok, "b": bad, "c": bad * torch.nan}
    with pytest.raises(FloatingPointError, match=r"Monte-Carlo diagonal of 'b' is not finite"):
        check_finite_result(diagonals, torch.float64, "Monte-Carlo")
    rounding = torch.tensor([1.0, -1e-15])  # below 64 eps of the largest entry: rounding
    check_db_diagonals({"a": rounding, "b": torch.zeros(0)})
    with pytest.raises(
        RuntimeError, match=r"DB diagonal of 'c' has negative entries \(smallest -0\.5"
    ):
        check_db_diagonals({"a": rounding, "b": torch.zeros(0), "c": torch.tensor([1.0, -0.5])})
    with pytest.raises(FloatingPointError, match=r"DB diagonal of 'b' is not finite"):
        check_db_diagonals(diagonals)


def test_finite_is_exact_where_the_sum_overflows_or_cancels():
    """One sum per tensor decides, and a non-finite sum is rechecked entry by entry."""
    inf, nan = float("inf"), float("nan")
    cases = {
        "finite": (torch.tensor([1.0, 2.0]), True),
        "nan": (torch.tensor([1.0, nan]), False),
        "inf - inf": (torch.tensor([inf, -inf]), False),
        "sum overflows": (torch.tensor([3e38, 3e38], dtype=torch.float32), True),
        "half near its max": (torch.tensor([6e4, 6e4], dtype=torch.float16), True),
        "half inf": (torch.tensor([1.0, inf], dtype=torch.float16), False),
        "empty": (torch.zeros(0), True),
        "complex": (torch.tensor([1 + 2j]), True),
    }
    got = all_finite([t for t, _ in cases.values()])
    assert dict(zip(cases, got, strict=True)) == {k: ok for k, (_, ok) in cases.items()}
    assert all_finite([]) == []


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [
        pytest.param(torch.float64, 1e3 * 2.0**-52, id="float64"),
        pytest.param(torch.float32, 1e3 * 2.0**-23, id="float32"),
        pytest.param(torch.float16, 16 * 2.0**-10, id="float16"),
        pytest.param(torch.bfloat16, 16 * 2.0**-7, id="bfloat16"),
    ],
)
def test_round_off_checks_scale_with_the_dtype_on_the_cpu(dtype, tolerance):
    """On the CPU no TF32: the dtype's eps (the CUDA float32 case is in test_gpu.py)."""
    t = torch.zeros(2, dtype=dtype)
    assert round_off(t) == torch.finfo(dtype).eps
    assert sum_tolerance(round_off(t)) == pytest.approx(tolerance)


def test_corruptions_draw_on_the_generator_and_keep_their_values():
    images = torch.randn(6, 2, 32, 32)
    noisy, box = noise_box(images, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    _, masks = sample_boxes(6, 32, generator=g)
    lo = images.flatten(1).amin(1).view(-1, 1, 1, 1)
    hi = images.flatten(1).amax(1).view(-1, 1, 1, 1)
    u = torch.rand(images.shape, generator=g, dtype=images.dtype)
    assert torch.equal(box, masks)
    assert torch.equal(noisy, torch.where(masks, lo + (hi - lo) * u, images))
    dark, _ = black_box(images, torch.tensor(-3.0), generator=torch.Generator().manual_seed(1))
    assert torch.equal(dark, torch.where(masks, torch.tensor(-3.0), images))
