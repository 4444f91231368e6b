import pytest
import torch

from lsn_ext.data import (
    histology_patches,
    load_histology,
    load_nuclei,
    load_nuclei_3d,
    nuclei_patches,
    nuclei_volume_slices,
    random_flips,
)


def test_shipped_files_load():
    image, mask = load_nuclei()
    assert image.shape == mask.shape == (512, 512)
    assert mask.dtype == torch.bool
    assert 0.15 < mask.double().mean() < 0.25  # PROVENANCE.md: about 20 % foreground
    assert image[mask].mean() > 2 * image[~mask].mean()  # nuclei are bright
    he = load_histology()
    assert he.shape == (300, 500)
    assert he.min() >= 0
    assert he.max() <= 255


def test_split_is_spatially_disjoint_and_patches_are_windows():
    s = nuclei_patches(64, 32)
    assert s.train_x.shape == (165, 1, 64, 64)
    assert s.val_x.shape == s.test_x.shape == (15, 1, 64, 64)
    image, mask = load_nuclei()
    norm = (image - s.mean) / s.std
    # patch (row 1, column 2) of the training band starts at (32, 64)
    torch.testing.assert_close(s.train_x[1 * 15 + 2, 0], norm[32:96, 64:128].to(s.train_x.dtype))
    torch.testing.assert_close(s.test_x[3, 0], norm[448:512, 96:160].to(s.test_x.dtype))
    torch.testing.assert_close(s.val_y[0, 0], mask[384:448, 0:64].to(s.val_y.dtype))
    # train rows [0, 384), val [384, 448), test [448, 512): no pixel shared
    torch.testing.assert_close(s.train_x.mean(), torch.zeros(()), atol=0.05, rtol=0)


def test_histology_patches_are_normalised_like_the_nuclei():
    s = nuclei_patches()
    he = histology_patches(s)
    assert he.shape == (28, 1, 64, 64)
    torch.testing.assert_close(he[0, 0], s.normalise(load_histology()[:64, :64]))
    assert he.mean() > s.test_x.mean() + 1  # bright H&E background: far OOD


def test_random_flips_flip_image_and_mask_together():
    x = torch.arange(2 * 16.0).view(2, 1, 4, 4)
    y = x.clone() * 10
    fx, fy = random_flips(x, y, torch.Generator().manual_seed(0))
    torch.testing.assert_close(fy, fx * 10)
    for i in range(2):
        candidates = [x[i], x[i].flip(-1), x[i].flip(-2), x[i].flip(-1).flip(-2)]
        assert any(torch.equal(fx[i], c) for c in candidates)
    flipped = [random_flips(x, y, torch.Generator().manual_seed(k))[0] for k in range(8)]
    assert any(not torch.equal(f, x) for f in flipped)


def test_nuclei_3d_volume_loads():
    volume, mask = load_nuclei_3d()
    assert volume.shape == mask.shape == (31, 61, 57)  # PROVENANCE.md: (z, y, x)
    assert volume.dtype == torch.float64
    assert mask.dtype == torch.bool
    assert volume.min() == 104
    assert volume.max() == 375
    assert 0.35 < mask.double().mean() < 0.42  # about 38 % foreground
    assert volume[mask].mean() > volume[~mask].mean() + 20  # nuclei are bright


def test_nuclei_volume_slices_are_standardised_and_keep_the_masks():
    volume, mask = load_nuclei_3d()
    x, y = nuclei_volume_slices(64)
    assert x.shape == y.shape == (31, 1, 64, 64)
    assert x.dtype == y.dtype == torch.get_default_dtype()
    assert set(y.unique().tolist()) == {0.0, 1.0}
    # 61 rows -> 64: reflect pad 1 above, 2 below; 57 columns -> 64: 3 left, 4 right
    centre_x, centre_y = x[:, 0, 1:62, 3:60], y[:, 0, 1:62, 3:60]
    torch.testing.assert_close(centre_y, mask.to(y.dtype), rtol=0, atol=0)
    norm = (volume - volume.mean()) / volume.std()
    torch.testing.assert_close(centre_x, norm.to(x.dtype))
    torch.testing.assert_close(centre_x.mean().item(), 0.0, rtol=0, atol=1e-6)
    torch.testing.assert_close(centre_x.std().item(), 1.0, rtol=0, atol=1e-6)
    assert abs(y.mean().item() - mask.double().mean().item()) < 0.03  # padding shifts it little
    # reflect padding: a padded pixel equals its mirror source (edge pixel not repeated)
    for t in (x, y):
        torch.testing.assert_close(t[..., 0, :], t[..., 2, :])  # row -1 mirrors row 1
        torch.testing.assert_close(t[..., 62, :], t[..., 60, :])  # row 61 mirrors row 59
        torch.testing.assert_close(t[..., 63, :], t[..., 59, :])
        torch.testing.assert_close(t[..., :, 0], t[..., :, 6])  # column -3 mirrors column 3
        torch.testing.assert_close(t[..., :, 63], t[..., :, 55])  # column 60 mirrors column 56
    assert not torch.equal(x[..., 0, :], x[..., 1, :])
    # smaller than the slice: a centre crop; 59 crops rows [1, 60) and pads 1 column each side
    x59, y59 = nuclei_volume_slices(59, dtype=torch.float32)
    assert x59.shape == (31, 1, 59, 59)
    assert x59.dtype == torch.float32
    torch.testing.assert_close(x59[:, 0, :, 1:58], norm[:, 1:60].float())
    torch.testing.assert_close(y59[:, 0, :, 0], y59[:, 0, :, 2])
    x8, _ = nuclei_volume_slices(8)
    torch.testing.assert_close(x8[:, 0], norm[:, 26:34, 24:32].to(x8.dtype))


@pytest.mark.parametrize(("size", "match"), [(7, "size >= 8"), (170, "size <= 169")])
def test_nuclei_volume_slices_reject_bad_sizes(size, match):
    with pytest.raises(ValueError, match=match):
        nuclei_volume_slices(size)
    assert nuclei_volume_slices(169)[0].shape == (31, 1, 169, 169)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.int64}, r"dtype must be floating .* got torch.int64"),
        ({"size": 64, "stride": 65}, r"stride=65 is larger than the patch side 64"),
        ({"size": 64, "stride": 0}, r"stride >= 1"),
        ({"size": 400}, r"3 \* size <= "),
    ],
    ids=["integer-dtype", "stride-skips-pixels", "zero-stride", "patch-too-large"],
)
def test_nuclei_patches_refuse_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nuclei_patches(**kwargs)
