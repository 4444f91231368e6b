import torch

from lsn_ext.data import (
    histology_patches,
    load_histology,
    load_nuclei,
    nuclei_patches,
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
