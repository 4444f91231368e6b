import pytest
import torch

from lsn_ext.data import synthetic_lesions


def test_synthetic_lesions_shapes_values_and_reproducibility():
    images, masks = synthetic_lesions(5, 32, channels=2, generator=torch.Generator().manual_seed(1))
    assert images.shape == (5, 2, 32, 32)
    assert masks.shape == (5, 1, 32, 32)
    assert set(masks.unique().tolist()) <= {0.0, 1.0}
    assert (masks.flatten(1).sum(1) > 0).all()
    assert 0.01 < masks.mean() < 0.6
    # Lesions are brighter than the background on average.
    assert (images * masks).sum() / masks.sum() > (images * (1 - masks)).sum() / (1 - masks).sum()
    again = synthetic_lesions(5, 32, channels=2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(again[0], images, rtol=0, atol=0)


def test_synthetic_lesions_rejects_bad_sizes():
    with pytest.raises(ValueError, match="size >= 4"):
        synthetic_lesions(2, 2)
