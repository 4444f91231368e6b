"""``lsn_ext.moments.RunningMoments`` against ``torch.mean``/``torch.var`` of stacked samples."""

import pytest
import torch

from lsn_ext.moments import RunningMoments


def _samples(S, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 + 2 * torch.randn(S, *shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("S", [2, 3, 17], ids=lambda s: f"S{s}")
def test_mean_and_variance_match_torch(S):
    xs = _samples(S, 2, 3, 4, 5)
    stats = RunningMoments()
    for x in xs:
        stats.add(x)
    assert stats.count == S
    torch.testing.assert_close(stats.mean, xs.mean(0), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(stats.variance, xs.var(0, unbiased=True), rtol=1e-12, atol=1e-14)


def test_covariance_over_the_class_axis_matches_centred_products():
    S = 9
    xs = _samples(S, 2, 3, 4, 5, seed=1)  # samples [N=2, C=3, 4, 5]
    stats = RunningMoments("covariance")
    stats.extend(xs)
    centred = xs - xs.mean(0)
    expected = torch.einsum("snchw,sndhw->ncdhw", centred, centred) / (S - 1)
    assert stats.variance.shape == (2, 3, 3, 4, 5)
    torch.testing.assert_close(stats.variance, expected, rtol=1e-12, atol=1e-13)
    diagonal = stats.variance.diagonal(dim1=1, dim2=2).movedim(-1, 1)
    torch.testing.assert_close(diagonal, xs.var(0), rtol=1e-12, atol=1e-13)


def test_mean_only_keeps_no_second_moment():
    xs = _samples(5, 3, 4, seed=2)
    stats = RunningMoments(None)
    stats.extend(xs)
    torch.testing.assert_close(stats.mean, xs.mean(0), rtol=1e-14, atol=1e-14)
    assert stats.m2 is None
    with pytest.raises(ValueError, match="second=None"):
        _ = stats.variance


def test_extend_of_a_stacked_tensor_equals_adding_one_by_one():
    xs = _samples(6, 2, 3, seed=3)
    one, stacked = RunningMoments(), RunningMoments()
    for x in xs:
        one.add(x)
    stacked.extend(xs)
    assert torch.equal(one.mean, stacked.mean)
    assert torch.equal(one.m2, stacked.m2)


def test_samples_are_neither_kept_nor_changed():
    xs = _samples(3, 2, 3, seed=4)
    before = xs.clone()
    stats = RunningMoments()
    stats.extend(xs)
    assert torch.equal(xs, before)
    assert stats.mean.data_ptr() not in {x.data_ptr() for x in xs}


def test_channels_last_samples_keep_their_layout():
    xs = _samples(3, 2, 3, 4, 5, seed=5)
    stats = RunningMoments()
    for x in xs:
        stats.add(x.contiguous(memory_format=torch.channels_last))
    assert stats.mean.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(stats.variance, xs.var(0), rtol=1e-12, atol=1e-14)


def test_a_variance_needs_two_samples():
    stats = RunningMoments()
    stats.add(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 samples"):
        _ = stats.variance


def test_an_unknown_second_moment_is_refused():
    with pytest.raises(ValueError, match="second must be one of"):
        RunningMoments("diagonal")
