"""The experiment kit (``integration/experiments/kit``): cache keys, shifts, early stopping, image
statistics, the nuclei volume's scale, and the bootstrap's histogram metrics against the exact
ones."""

import pytest
import torch

from integration.experiments import kit
from lsn_ext import metrics
from lsn_ext.data import load_nuclei_3d, nuclei_patches, nuclei_volume_slices


@pytest.mark.parametrize(
    ("budget", "key"),
    [
        (kit.Budget(), "9646edcf"),
        (kit.QUICK, "86288526"),
        (kit.ConvergedBudget(), "9e3ee2cd"),
        (kit.CONVERGED_QUICK, "f5bb0ad8"),
    ],
    ids=["paper", "paper-quick", "converged", "converged-quick"],
)
def test_cache_keys_are_those_of_the_caches_on_disk(budget, key):
    """Every cache file name ends in its budget's key, a hash of the budget's fields alone (not of
    its class or module): the full budgets' keys are those of the caches written before the kit
    existed; the quick ones' caches are temporary, their keys those of their current sizes
    (issue 41 made them smaller)."""
    assert budget.key() == key


def test_shifts_change_the_images_as_documented():
    x = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    mean = x.mean((-1, -2), keepdim=True)
    torch.testing.assert_close(kit.shift(x, "contrast", 0.5), mean + 0.5 * (x - mean))
    torch.testing.assert_close(kit.shift(x, "intensity", 2.0), 2 * x)
    blurred = kit.shift(x, "blur", 1.0)
    assert blurred.shape == x.shape
    torch.testing.assert_close(blurred.mean(), x.mean(), atol=0.05, rtol=0)
    assert blurred.std() < 0.7 * x.std()
    flat = torch.ones(1, 1, 8, 8)
    torch.testing.assert_close(kit.shift(flat, "blur", 2.0), flat)
    noisy = kit.shift(x, "noise", 0.5)
    assert 0.4 < (noisy - x).std() < 0.6
    with pytest.raises(ValueError, match="unknown shift"):
        kit.shift(x, "rotate", 1.0)


def test_bootstrap_histograms_agree_with_the_exact_metrics():
    b = kit.ConvergedBudget()
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(12, 1, 16, 16, generator=g, dtype=torch.float64)
    mean = torch.sigmoid(logits)
    y = (torch.rand(12, 1, 16, 16, generator=g, dtype=torch.float64) < mean).double()
    pred = kit.Pred(mean, kit.entropy_binary(mean), None, None)
    exact, sums = kit.measure(pred, y, b, kit.histogram_edges([mean], b))
    every = torch.arange(12).unsqueeze(0)  # the identity "resample"
    for metric in ("auroc", "auprc", "ece", "nll", "brier"):
        got = kit.boot_pixel_metric(metric, sums, every).item()
        tol = {"auroc": 2e-3, "auprc": 1e-2}.get(metric, 1e-9)  # binned: ties within a bin
        assert got == pytest.approx(exact[metric], abs=tol), metric
        many = torch.randint(0, 12, (5, 12), generator=g)
        assert kit.boot_pixel_metric(metric, sums, many).shape == (5,), metric
    per = {k: exact[k] for k in ("u_mean", "u_fg", "dice_per_image")}
    for metric in ("aurc", "e_aurc", "spearman"):
        got = kit.boot_image_metric(metric, per, every).item()
        assert got == pytest.approx(exact[metric], abs=1e-9), metric
    n, fn = kit.shift_boot([0.1, 0.5, 0.3], [0.4, 0.9])
    assert n == 6
    idx = torch.tensor([[0, 1, 2, 3, 4, 5]])  # clean 0, 1, 2; shifted (i // 3) % 2 = 1, 1
    assert fn(idx).item() == pytest.approx(
        metrics.auroc(torch.tensor([0.1, 0.5, 0.3]), torch.tensor([0.9, 0.9]))
    )


def test_image_statistics_score_is_a_mahalanobis_distance():
    g = torch.Generator().manual_seed(1)
    train = torch.randn(200, 1, 8, 8, generator=g) * (1 + torch.rand(200, 1, 1, 1, generator=g))
    d = kit.image_statistics(train, {"same": train[:5], "bright": 5 + train[:5]})
    assert min(d["bright"]) > max(d["same"])
    s = torch.stack([train.double().flatten(1).mean(1), train.double().flatten(1).std(1)], 1)
    diff = s[0] - s.mean(0)
    ref = (diff @ torch.linalg.inv(torch.cov(s.T)) @ diff).sqrt().item()
    assert d["same"][0] == pytest.approx(ref, rel=1e-6)


def test_early_stopping_keeps_the_best_weights_and_respects_min_steps_and_floor():
    def run(scores, **kw):
        net = torch.nn.Linear(1, 1)
        it = iter(scores)
        stop = kit.EarlyStopping(lambda n: next(it), every=10, patience=2, **kw)
        for step in range(1, 101):
            with torch.no_grad():
                net.weight.fill_(step)
            if stop.check(net, step, last=step == 100):
                break
        stop.restore(net)
        return stop, net.weight.item()

    stop, w = run([0.1, 0.5, 0.4, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert (stop.best_step, stop.steps_run, stop.stopped, w) == (20, 40, True, 20.0)
    stop, _ = run([0.1, 0.5, 0.4, 0.3, 0.2, 0.1, 0.9, 0.1, 0.1, 0.1], min_steps=60)
    assert (stop.best_step, stop.steps_run) == (20, 60)
    stop, w = run([0.0] * 6 + [0.3] + [0.1] * 3, floor=0.0)  # Dice 0: no stop until it moves
    assert (stop.best_step, stop.steps_run, stop.stopped, w) == (70, 90, True, 70.0)
    assert run([0.0] * 6 + [0.3] + [0.1] * 3)[0].steps_run == 30  # without the floor


def test_volume_on_the_training_scale_keeps_the_volume_intensity_shift():
    own, _ = nuclei_volume_slices(64, dtype=torch.float64)
    train = kit.volume_on_training_scale(own)
    volume, _ = load_nuclei_3d()
    splits = nuclei_patches(64, 32, dtype=torch.float64)
    # slices 61 × 57 reflect-padded to 64: row r of the volume is row r + 1, column c is c + 3
    expected = splits.normalise(volume[:, 30, 28])
    torch.testing.assert_close(train[:, 0, 31, 31], expected, rtol=0, atol=1e-9)
    assert own.mean().abs() < 0.1  # standardised by its own statistics
    assert train.mean() > 0.5  # brighter than the training band: the shift is kept
