import pytest
import torch

from lsn_ext.data import lesion_dataset, synthetic_lesions


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


@pytest.fixture(scope="module")
def lesions() -> tuple[torch.Tensor, torch.Tensor]:
    return lesion_dataset(600, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_lesion_dataset_shapes_masks_and_reproducibility(lesions):
    images, masks = lesions
    assert images.shape == (600, 3, 64, 64)
    assert masks.shape == (600, 1, 64, 64)
    assert images.dtype == masks.dtype == torch.float32
    assert set(masks.unique().tolist()) == {0.0, 1.0}
    assert (masks.flatten(1).sum(1) > 0).all()  # every image has a lesion
    assert torch.isfinite(images).all()
    images2, masks2 = lesion_dataset(600, generator=torch.Generator().manual_seed(0))
    assert torch.equal(images2, images)
    assert torch.equal(masks2, masks)
    other, _ = lesion_dataset(600, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other, images)
    small, small_masks = lesion_dataset(3, 16, generator=torch.Generator().manual_seed(0))
    assert small.shape == (3, 3, 16, 16)
    assert small_masks.shape == (3, 1, 16, 16)


@pytest.mark.slow
def test_lesion_dataset_hits_the_foreground_share(lesions):
    _, masks = lesions
    assert abs(masks.mean().item() - 1 / 9) < 0.02  # the paper's 1:8 imbalance
    share = masks.mean((1, 2, 3))
    assert share.std() > 0.03  # sizes vary ...
    assert (share < 0.02).any()  # ... with the occasional tiny lesion
    _, quarter = lesion_dataset(600, foreground=0.25, generator=torch.Generator().manual_seed(2))
    assert abs(quarter.mean().item() - 0.25) < 0.02


@pytest.mark.slow
def test_lesion_dataset_is_standardised_with_fixed_constants(lesions):
    images, masks = lesions
    mean, std = images.mean((0, 2, 3)), images.std((0, 2, 3))
    assert (mean.abs() < 0.3).all(), mean
    assert ((std > 0.6) & (std < 1.6)).all(), std
    # fixed constants, not per-call statistics: a call with more (dark) lesion pixels comes out
    # darker on the same scale, where per-call standardisation would centre it at 0 again
    dark, _ = lesion_dataset(200, foreground=0.25, generator=torch.Generator().manual_seed(3))
    assert (dark.mean((0, 2, 3)) < mean - 0.15).all()
    # lesions are darker than the skin around them
    lum = images.mean(1, keepdim=True)
    assert lum[masks > 0].mean() < lum[masks == 0].mean() - 1


def _rings(masks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels at chessboard distance ``k`` outside and inside the mask boundary."""

    def dilate(t: torch.Tensor, r: int) -> torch.Tensor:
        return torch.nn.functional.max_pool2d(t, 2 * r + 1, 1, r)

    outside = dilate(masks, k) - dilate(masks, k - 1)
    inside = (1 - dilate(1 - masks, k - 1)) - (1 - dilate(1 - masks, k))
    return outside > 0, inside > 0


@pytest.mark.slow
def test_lesion_dataset_boundary_is_fuzzy(lesions):
    images, masks = lesions
    lum = images.mean(1, keepdim=True)
    grad = torch.zeros_like(lum)
    grad[..., :-1, :-1] = torch.hypot(
        lum[..., 1:, :-1] - lum[..., :-1, :-1], lum[..., :-1, 1:] - lum[..., :-1, :-1]
    )
    out1, in1 = _rings(masks, 1)
    out3, in3 = _rings(masks, 3)
    far = torch.nn.functional.max_pool2d(masks, 17, 1, 8) == 0
    assert grad[out1 | in1].mean() > 2 * grad[far].mean()  # the edge is where the mask says
    # The intensity ramps over several pixels: the pixels next to the boundary lie clearly
    # between skin (3 px out) and lesion (3 px in). A one-pixel step (image = f(mask)) would give
    # lum[out1] == lum[out3] and lum[in1] == lum[in3] (up to texture), i.e. ratios near 0.
    contrast = lum[out3].mean() - lum[in3].mean()
    assert contrast > 1
    assert (lum[out3].mean() - lum[out1].mean()) / contrast > 0.1
    assert (lum[in1].mean() - lum[in3].mean()) / contrast > 0.1
    step = -masks + 0.1 * torch.randn_like(masks)  # control: the same measure on a hard step
    step_contrast = step[out3].mean() - step[in3].mean()
    assert abs(step[out3].mean() - step[out1].mean()) / step_contrast < 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n >= 1"),
        ({"n": 2, "size": 15}, "size >= 16"),
        ({"n": 2, "foreground": 0.0}, "foreground"),
        ({"n": 2, "foreground": 0.5}, "foreground"),
    ],
)
def test_lesion_dataset_rejects_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lesion_dataset(**kwargs)
