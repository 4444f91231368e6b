"""``lsn_ext.links``: the link decisions and maps against independent float64 references."""

import math

import numpy as np
import pytest
import torch
from scipy import special

from lsn_ext.links import (
    LINKS,
    NoLinkError,
    categorical_entropy,
    check_link,
    inverse_link,
    link_of_channels,
    link_of_likelihood,
    link_of_loss,
    sigmoid_as_softmax,
)
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss
from lsn_ext.rules.ssn_likelihood import ExpectedBCE, LogsumexpBCE


def _logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize(
    ("loss", "link"),
    [
        (BCEWithLogits(), "sigmoid"),
        (ExpectedBCE(), "sigmoid"),
        (LogsumexpBCE(2), "sigmoid"),
        (CrossEntropy(), "softmax"),
        (MSE(), "identity"),
    ],
    ids=["bce", "expected-bce", "logsumexp-bce", "ce", "mse"],
)
def test_link_of_loss(loss, link):
    assert link_of_loss(loss) == link


def test_a_loss_without_a_link_is_refused_as_type_and_value_error():
    class Custom(Loss):
        pass

    for call in (lambda: link_of_loss(Custom()), lambda: link_of_loss(object())):
        with pytest.raises(NoLinkError, match="no predictive link for loss"):
            call()
    assert issubclass(NoLinkError, TypeError)
    assert issubclass(NoLinkError, ValueError)


@pytest.mark.parametrize(
    ("likelihood", "loss", "link"),
    [
        ("regression", MSE(), "identity"),
        ("regression", None, "identity"),
        ("reward_modeling", CrossEntropy(), "identity"),
        ("classification", None, "softmax"),
        ("classification", CrossEntropy(), "softmax"),
        ("classification", BCEWithLogits(), "sigmoid"),
    ],
    ids=["regression", "regression-no-loss", "reward", "ce-backend", "ce", "bce"],
)
def test_link_of_likelihood(likelihood, loss, link):
    assert link_of_likelihood(likelihood, loss) == link


def test_a_classification_likelihood_with_a_regression_loss_has_no_link():
    with pytest.raises(NoLinkError, match="no predictive link for loss MSE"):
        link_of_likelihood("classification", MSE())


@pytest.mark.parametrize(("channels", "link"), [(1, "sigmoid"), (2, "softmax"), (5, "softmax")])
def test_link_of_channels(channels, link):
    assert link_of_channels(channels) == link


def test_check_link():
    for link in LINKS:
        assert check_link(link) == link
    with pytest.raises(ValueError, match="must be one of"):
        check_link("probit")


@pytest.mark.parametrize("dim", [1, 2], ids=["dim1", "dim2"])
def test_inverse_link_softmax_against_numpy(dim):
    f = _logits(2, 3, 4, 5)
    expected = np.exp(f.numpy()) / np.exp(f.numpy()).sum(dim, keepdims=True)
    np.testing.assert_allclose(inverse_link(f, "softmax", dim).numpy(), expected, rtol=1e-14)


def test_inverse_link_sigmoid_and_identity_against_numpy():
    f = _logits(2, 1, 4, 5)
    expected = 1 / (1 + np.exp(-f.numpy()))
    np.testing.assert_allclose(inverse_link(f, "sigmoid").numpy(), expected, rtol=1e-14)
    assert inverse_link(f, "identity") is f


@pytest.mark.parametrize("link", ["softmax", "sigmoid"])
def test_categorical_entropy_against_scipy(link):
    f = _logits(3, 4, 2, 5, seed=1)
    p = inverse_link(f, link).numpy()
    if link == "softmax":
        expected = special.entr(p).sum(1)
    else:
        expected = (special.entr(p) + special.entr(1 - p)).sum(1)
    got = categorical_entropy(torch.from_numpy(p), link)
    assert got.shape == (3, 2, 5)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-13)


def test_categorical_entropy_counts_zero_probabilities_as_zero():
    p = torch.tensor([[[1.0], [0.0]], [[0.5], [0.5]]], dtype=torch.float64)  # [2, 2, 1]
    got = categorical_entropy(p, "softmax")
    torch.testing.assert_close(got, torch.tensor([[0.0], [math.log(2)]], dtype=torch.float64))
    assert torch.isfinite(categorical_entropy(p, "sigmoid")).all()


def test_sigmoid_as_softmax_is_the_exact_linear_map():
    m, v = _logits(2, 1, 3, 4, seed=2), _logits(2, 1, 3, 4, seed=3).abs()
    mu, var = sigmoid_as_softmax(m, v)
    assert mu.shape == var.shape == (2, 2, 3, 4)
    # the logits are A f with A = [-1/2, 1/2]: mean A m, covariance diagonal A² v
    A = torch.tensor([-0.5, 0.5], dtype=torch.float64).view(1, 2, 1, 1)
    torch.testing.assert_close(mu, A * m, rtol=0, atol=0)
    torch.testing.assert_close(var, A**2 * v, rtol=0, atol=0)
    torch.testing.assert_close(mu.sum(1), torch.zeros_like(m[:, 0]), rtol=0, atol=0)
    # softmax of the two logits: class 1 is σ(f)
    torch.testing.assert_close(torch.softmax(mu, 1)[:, 1:], torch.sigmoid(m))
