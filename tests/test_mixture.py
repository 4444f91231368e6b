"""lsn_ext.lsn.mixture_predict: the mixture of Laplaces (one posterior per ensemble member)
against a reference built by hand from the members' own lsn_ext.predict maps, against the plain
ensemble at a point-mass posterior, and its refusals."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.lsn import ensemble_predict, mixture_predict
from lsn_ext.models import UNet

N, SIZE = 4, 16


def _data(classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 1, SIZE, SIZE, generator=g)
    if classes == 1:
        return x, (torch.rand(N, 1, SIZE, SIZE, generator=g) > 0.5).double()
    return x, torch.randint(0, classes, (N, SIZE, SIZE), generator=g)


def _posterior(classes: int, seed: int, prior_precision: float = 1.0):
    """A fitted diagonal Laplace over all weights of a tiny U-Net (BCE for one channel)."""
    torch.manual_seed(seed)
    net = UNet(1, classes, widths=(4, 8)).eval()
    options = {"backend_kwargs": {"loss": "bce"}} if classes == 1 else {}
    la = lsn_ext.Laplace(
        net, "classification", "all", "diag", prior_precision=prior_precision, **options
    )
    la.fit(DataLoader(TensorDataset(*_data(classes)), batch_size=N))
    return la


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Bernoulli entropy for one channel, categorical for more (written out here)."""
    if p.shape[1] == 1:
        return -(p * p.log() + (1 - p) * (1 - p).log())[:, 0]
    return -(p * p.log()).sum(1)


CASES = [(1, "nn"), (1, "glm"), (3, "nn"), (3, "glm")]
IDS = ["binary-nn", "binary-glm", "3-class-nn", "3-class-glm"]


@pytest.mark.parametrize(("classes", "pred_type"), CASES, ids=IDS)
def test_mixture_equals_the_mixture_of_the_members_maps(one_thread, classes, pred_type):
    posteriors = [_posterior(classes, seed) for seed in (1, 2, 3)]
    x = _data(classes)[0]
    seed = 7
    members = [
        lsn_ext.predict(
            la, x, 6, pred_type=pred_type, generator=torch.Generator().manual_seed(seed + k)
        )
        for k, la in enumerate(posteriors)
    ]
    mix = mixture_predict(posteriors, x, 6, pred_type=pred_type, seed=seed)

    means = torch.stack([m.mean for m in members])
    mean = means.mean(0)
    variance = torch.stack([m.variance for m in members]).mean(0) + ((means - mean) ** 2).mean(0)
    entropy = _entropy(mean)
    expected = torch.stack([m.entropy - m.mutual_information for m in members]).mean(0)
    torch.testing.assert_close(mix.mean, mean)
    torch.testing.assert_close(mix.variance, variance)
    torch.testing.assert_close(mix.entropy, entropy)
    torch.testing.assert_close(mix.mutual_information, (entropy - expected).clamp_min(0))
    assert (mix.mutual_information > 0).any()
    assert mix.n_samples == 18
    assert (mix.pred_type, mix.link_approx) == (pred_type, "mc")
    assert mix.mean.shape == mix.variance.shape == (N, classes, SIZE, SIZE)
    assert mix.entropy.shape == mix.mutual_information.shape == (N, SIZE, SIZE)
    if classes > 1:
        torch.testing.assert_close(mix.mean.sum(1), torch.ones(N, SIZE, SIZE))


@pytest.mark.parametrize("classes", [1, 3], ids=["binary", "3-class"])
def test_point_mass_mixture_is_the_plain_ensemble(one_thread, classes):
    posteriors = [_posterior(classes, seed, prior_precision=1e12) for seed in (1, 2)]
    x = _data(classes)[0]
    mix = mixture_predict(posteriors, x, 4)
    ens = ensemble_predict([la.model for la in posteriors], x)
    k = len(posteriors)
    torch.testing.assert_close(mix.mean, ens.mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(mix.entropy, ens.entropy, atol=1e-6, rtol=0)
    torch.testing.assert_close(mix.mutual_information, ens.mutual_information, atol=1e-6, rtol=0)
    # the ensemble's variance is unbiased over its members, the mixture's between-members part
    # the population variance
    torch.testing.assert_close(mix.variance, ens.variance * (k - 1) / k, atol=1e-6, rtol=0)
    assert ens.mutual_information.max() > 1e-3  # the members differ


def test_mixture_refuses_bad_members(one_thread):
    binary = [_posterior(1, seed) for seed in (1, 2)]
    x = _data(1)[0]
    for few in ([], binary[:1]):
        with pytest.raises(ValueError, match=f"at least 2 posteriors.*got {len(few)}"):
            mixture_predict(few, x, 4)
    with pytest.raises(ValueError, match="posterior 2 has the 'softmax' link"):
        mixture_predict([*binary, _posterior(3, 3)], x, 4)
    with pytest.raises(ValueError, match=r"posterior 1 predicts outputs \(4, 4, 16, 16\)"):
        mixture_predict([_posterior(3, 1), _posterior(4, 2)], x, 4)
    with pytest.raises(TypeError, match="posterior 1: "):
        mixture_predict([binary[0], object()], x, 4)
    with pytest.raises(ValueError, match="n_samples"):
        mixture_predict(binary, x, 1)
