"""Per-pixel predictives of a posterior: :func:`predict` and :func:`bridge_predictive`.

:func:`predict` samples the network (``pred_type="nn"``) or its linearisation (``"glm"``) at
posterior draws and turns the logits into maps through the posterior's link
(:mod:`lsn_ext.links`) and a link approximation (``"mc"``, ``"probit"``, ``"bridge"``);
:func:`bridge_predictive` gives the Laplace-Bridge Dirichlet (:mod:`lsn_ext.bridge`) of a
laplace-torch posterior.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import tqdm
from torch import Tensor, nn

from lsn_ext import distributed as _dist
from lsn_ext._functional import functional_call_all, unflatten
from lsn_ext.bridge import BridgeDirichlet, LaplaceBridge, Norm
from lsn_ext.forward import linearized_variance
from lsn_ext.glm import linearized_tangents, sample_chunks
from lsn_ext.laplace_ext.backend import link_of
from lsn_ext.laplace_ext.checks import (
    check_choice,
    check_eval_norms,
    check_fitted,
    check_images,
    check_n_samples,
    dict_input,
    trainable_params,
)
from lsn_ext.laplace_ext.head_posterior import head_logit_draws, head_logit_moments, is_last_layer
from lsn_ext.links import categorical_entropy, inverse_link, sigmoid_as_softmax
from lsn_ext.moments import RunningMoments
from lsn_ext.outputs import plain_tensor
from lsn_ext.sliding import SlidingWindow, as_window
from lsn_ext.vi import GaussianMixture

__all__ = [
    "LINK_APPROXES",
    "PRED_TYPES",
    "NonFinitePredictiveError",
    "SegmentationPrediction",
    "bridge_predictive",
    "glm_logits",
    "logit_draws",
    "predict",
]


@dataclass
class SegmentationPrediction:
    """Per-pixel predictive maps from :func:`predict`.

    Shapes for logits ``[N, C, *spatial]`` (``C = 1`` for binary segmentation, where the maps
    refer to the foreground probability ``σ(f)``):

    Attributes:
        mean: Predictive mean probability ``E[p]``, ``[N, C, *]`` (regression: mean output),
            from the link approximation (see :func:`predict`).
        variance: Epistemic variance of the probabilities ``Var[p]``, ``[N, C, *]``
            (regression: variance of the outputs): over the samples, or the Dirichlet's with
            ``link_approx="bridge"``.
        entropy: Predictive entropy ``H[E p]`` in nats, ``[N, *]`` (classification only).
        mutual_information: ``H[E p] − E H[p]`` (epistemic part of the entropy), ``[N, *]``.
        n_samples: Number of posterior samples used.
        logit_mean: Mean of the logits ``[N, C, *]``: ``f(x; θ*)`` for the GLM predictive, the
            sample mean for the sampling one (``None`` where not computed).
        logit_variance: Per-output variance of the logits ``[N, C, *]``: the estimate of
            ``diag(J Σ Jᵀ)`` for the GLM predictive, the sample variance for the sampling one.
        pred_type: ``"glm"`` or ``"nn"``.
        link_approx: ``"mc"``, ``"probit"`` or ``"bridge"``.
    """

    mean: Tensor
    variance: Tensor
    entropy: Tensor | None
    mutual_information: Tensor | None
    n_samples: int
    logit_mean: Tensor | None = None
    logit_variance: Tensor | None = None
    pred_type: str = "nn"
    link_approx: str = "mc"


PRED_TYPES = ("glm", "nn")
LINK_APPROXES = ("mc", "probit", "bridge")


def _check_logits(f: Any, link: str) -> Tensor:
    if not isinstance(f, Tensor) or f.dim() < 2:
        shape = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
        raise ValueError(f"expected logits [N, C, *], got {shape}")
    if link == "softmax" and f.shape[1] == 1:
        raise ValueError(
            f"a softmax over one logit channel (logits {tuple(f.shape)}) is 1 everywhere: "
            "this posterior has no BCE loss. For binary segmentation create the Laplace "
            "with backend_kwargs={'loss': 'bce'} (also when loading a state_dict: "
            "laplace-torch does not save the backend's loss)"
        )
    return f


def _outer(t: Tensor) -> Tensor:
    """Per-position outer product over the class axis: ``[N, C, *]`` → ``[N, C, C, *]``."""
    return t.unsqueeze(2) * t.unsqueeze(1)


class _SampleMaps:
    """Running moments over the samples: of the probabilities, their entropy and the logits.

    ``probs``: mean and variance of ``p = g(f)`` (the link's inverse, :mod:`lsn_ext.links`);
    ``entropy``: the mean ``E H[p]`` (``None`` for the identity link); ``logits``: mean and
    variance of the logits added with ``logits=True``, or with ``full`` their per-position
    covariance over the class axis ``[N, C, C, *]`` (for the Laplace Bridge with a softmax link).
    """

    def __init__(self, link: str, full: bool):
        self.link = link
        self.probs = RunningMoments()
        self.entropy = None if link == "identity" else RunningMoments(None)
        self.logits = RunningMoments("covariance" if full else "variance")

    def add(self, f: Tensor, logits: bool) -> None:
        p = inverse_link(f, self.link)
        self.probs.add(p)
        if self.entropy is not None:
            self.entropy.add(categorical_entropy(p, self.link))
        if logits:
            self.logits.add(f)


def _nn_logits(
    la: Any,
    model: nn.Module,
    named: list[tuple[str, Tensor]],
    x: Tensor,
    n: int,
    generator: Any,
    window: SlidingWindow | None = None,
) -> Iterator[Tensor]:
    """Logits of the network at ``n`` posterior draws (sampling predictive; ``window``: blended)."""
    buffers = dict(model.named_buffers())
    for chunk in sample_chunks(la.sample, n, la.n_params, generator):
        for theta in chunk:
            params = unflatten(named, theta)
            params.update({n: b.clone() for n, b in buffers.items()})
            network = lambda inputs, p=params: functional_call_all(model, p, (inputs,))  # noqa: E731
            yield network(x) if window is None else plain_tensor(window(network, x))


def _posterior_mean(la: Any, named: list[tuple[str, Tensor]]) -> Tensor:
    mean = getattr(la, "mean", None)
    P = sum(p.numel() for _, p in named)
    if not isinstance(mean, Tensor) or mean.shape != (P,):
        shape = tuple(mean.shape) if isinstance(mean, Tensor) else type(mean).__name__
        raise ValueError(
            f"the GLM predictive linearises at the posterior mean, which must be a vector [{P}] "
            f"over the trainable parameters; la.mean is {shape}. Use pred_type='nn'"
        )
    if isinstance(getattr(la, "q", None), GaussianMixture):
        raise ValueError(
            "the GLM predictive of a Gaussian mixture would linearise every component at the "
            "mixture's mean; use pred_type='nn' for a GaussianMixture posterior"
        )
    return mean.detach()


def glm_logits(
    la: Any,
    model: nn.Module,
    named: list[tuple[str, Tensor]],
    x: Tensor,
    n: int,
    generator: Any,
    window: SlidingWindow | None = None,
) -> tuple[Tensor, Iterator[Tensor]]:
    """``f(x; θ*)`` and the products ``J δ_s`` of ``⌈n/2⌉`` posterior draws ``θ* + δ_s``.

    The draws are ``la.sample`` in chunks; the antithetic partner ``θ* − δ_s`` of each is left to
    the caller (see :mod:`lsn_ext.glm`). ``f(x; θ*) ± J δ_s`` are exact draws of the linearised
    (GLM) predictive; ``J δ_s`` is one forward-mode product per draw, without forming ``J``.

    Args:
        la: A fitted posterior with ``sample`` and ``mean`` (laplace-torch ``Laplace`` or
            :class:`~lsn_ext.VariationalPosterior`).
        model: The network (unwrapped from any data-parallel wrapper).
        named: Its trainable ``(name, parameter)`` pairs, the posterior's layout
            (:func:`~lsn_ext.laplace_ext.checks.trainable_params`).
        x: Inputs ``[N, C_in, *]``.
        n: Number of predictive draws ``n``; ``⌈n/2⌉`` products are made.
        generator: Random generator of ``la.sample``.
        window: Sliding-window inference of the network (``None``: ``x`` whole).

    Returns:
        ``(f(x; θ*), tangents)``: the logits at the mean ``[N, C, *]`` and a lazy iterator over
        the ``⌈n/2⌉`` products ``J δ_s``, each ``[N, C, *]``.
    """
    mean = _posterior_mean(la, named)
    pairs = (n + 1) // 2
    deltas = (
        theta - mean
        for chunk in sample_chunks(la.sample, pairs, la.n_params, generator)
        for theta in chunk
    )
    run = None if window is None else lambda net, inputs: plain_tensor(window(net, inputs))
    return linearized_tangents(model, [n for n, _ in named], mean, x, deltas, run)


def _bridge_maps(link: str, f_mean: Tensor, f_second: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, variance and expected entropy ``E H[p]`` of the Laplace-Bridge Dirichlet per pixel.

    ``f_second``: per-pixel logit variances ``[N, 1, *]`` (sigmoid) or covariances over the
    classes ``[N, K, K, *]`` (softmax).
    """
    if link == "sigmoid":
        # Binary logit f ~ N(m, v) as two zero-sum logits [−f/2, f/2], exact (bridge_predictive)
        mu, var = sigmoid_as_softmax(f_mean, f_second)
        d = LaplaceBridge(project=False)(mu, var)
        alpha, probs, probs_var = d.alpha, d.probs[:, 1:], d.probs_variance[:, 1:]
    else:
        # Pixels into the batch: [M, K] means and [M, K, K] covariances (exact projection).
        K = f_mean.shape[1]
        mu = f_mean.movedim(1, -1).reshape(-1, K)
        cov = f_second.movedim(1, -1).movedim(1, -1).reshape(-1, K, K)
        d = LaplaceBridge()(mu, cov)
        shape = (*f_mean.shape[:1], *f_mean.shape[2:], K)
        alpha, probs, probs_var = (
            t.reshape(shape).movedim(-1, 1) for t in (d.alpha, d.probs, d.probs_variance)
        )
    alpha0 = alpha.sum(1)
    expected_entropy = torch.special.digamma(alpha0 + 1) - (
        alpha / alpha0.unsqueeze(1) * torch.special.digamma(alpha + 1)
    ).sum(1)
    return tuple(t.to(f_mean.dtype) for t in (probs, probs_var, expected_entropy))


class _Progress:
    """The tqdm bars (on stderr) of ``predict(..., progress_bar=True)``; a context manager.

    One bar over the posterior draws (over the antithetic pairs for the GLM predictive) and, with
    a window, one over the window batches of the current sliding-window pass: :attr:`window`
    counts the network calls of ``window`` (one per batch of windows; their number per pass is
    known after the first pass). Disabled, the bars write nothing and :attr:`window` is
    ``window``; either way the draws and the logits are the same.
    """

    def __init__(self, enabled: bool, pred_type: str, n_samples: int, window: Any) -> None:
        glm = pred_type == "glm"
        self._draws = tqdm.tqdm(
            total=(n_samples + 1) // 2 if glm else n_samples,
            desc="predict: antithetic pairs" if glm else "predict: posterior draws",
            unit="pair" if glm else "draw",
            disable=not enabled,
        )
        self._windows = tqdm.tqdm(
            desc="windows", unit="batch", leave=False, disable=not enabled or window is None
        )
        self._per_pass: int | None = None
        self.window = window if self._windows.disable else self._counted(window)

    def _counted(self, window: Any) -> Any:
        def counted_window(network: Any, x: Tensor) -> Tensor:
            calls = 0

            def counted(*args: Any, **kwargs: Any) -> Tensor:
                nonlocal calls
                calls += 1
                self._windows.update()
                return network(*args, **kwargs)

            self._windows.reset(total=self._per_pass)
            out = window(counted, x)
            self._per_pass = calls
            return out

        return counted_window

    def draws(self, iterable: Iterator[Tensor]) -> Iterator[Tensor]:
        """``iterable``, advancing the bar once per item consumed."""
        for item in iterable:
            yield item
            self._draws.update()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._windows.close()
        self._draws.close()


class NonFinitePredictiveError(ValueError):
    """:func:`predict` gave non-finite maps (a posterior too wide for the dtype)."""


def _check_maps(prediction: SegmentationPrediction, la: Any) -> SegmentationPrediction:
    """Refuse non-finite maps, naming the likely cause (samples that overflow the dtype)."""
    for name in ("mean", "variance", "logit_variance"):
        value = getattr(prediction, name)
        if value is not None and not bool(torch.isfinite(value).all()):
            prior = getattr(la, "prior_precision", None)
            prior_text = ""
            if isinstance(prior, Tensor):
                prior_text = f" (prior precision {float(prior.min()):.3g} at its smallest)"
            raise NonFinitePredictiveError(
                f"the predictive {name} has non-finite values in {value.dtype}: the posterior "
                f"samples make the network overflow{prior_text}. The posterior is too wide for "
                f"this network in {value.dtype}: raise the prior precision (e.g. "
                "lsn_ext.gridsearch_prior_precision), or run model and inputs in float64"
            )
    return prediction


@torch.no_grad()
def predict(
    la: Any,
    x: Tensor,
    n_samples: int = 50,
    *,
    pred_type: Literal["glm", "nn"] = "nn",
    link_approx: Literal["mc", "probit", "bridge"] = "mc",
    generator: torch.Generator | None = None,
    window: SlidingWindow | Sequence[int] | None = None,
    progress_bar: bool = False,
) -> SegmentationPrediction:
    r"""Per-pixel predictive of a fitted Laplace approximation (or any Gaussian posterior).

    Two predictives, named as in laplace-torch:

    - ``pred_type="glm"``: the linearised network ``f(x; θ*) + J(x)(θ − θ*)``, whose logits
      are Gaussian, ``N(f(x; θ*), J Σ Jᵀ)`` per pixel. Sampled by one forward-mode
      Jacobian-vector product per pair of antithetic draws ``θ* ± δ`` (:mod:`lsn_ext.glm`):
      memory of one forward pass, linear in the pixels, independent of ``n_samples``. The
      logit mean is exactly ``f(x; θ*)``; the logit variance is the unbiased estimate
      ``(1/S) Σ_s (J δ_s)²`` of ``diag(J Σ Jᵀ)`` over ``S = ⌈n_samples/2⌉`` products.
    - ``pred_type="nn"``: the network itself at ``n_samples`` posterior draws.

    The probabilities (softmax over dim 1; sigmoid for a BCE backend) then come from
    ``link_approx``:

    - ``"mc"``: averages over the sampled logits: ``E p``, ``Var p`` and ``E H[p]`` (for the
      mutual information), one pass (Welford).
    - ``"probit"``: from the per-pixel logit mean ``m`` and variance ``v``,
      ``softmax(κ m)`` (``σ(κ m)`` for a sigmoid) with ``κ = 1/√(1 + π v/8)`` (laplace-torch's
      probit, using the diagonal of the logit covariance); ``variance`` and ``E H[p]`` are
      still the sample ones.
    - ``"bridge"``: the Laplace Bridge (:func:`lsn_ext.laplace_bridge`) per pixel, from the
      logit mean and the per-pixel *covariance* over classes (softmax, exact zero-sum
      projection; it costs ``C×`` the memory of the logits) or variance (sigmoid, as the two
      logits ``[−f/2, f/2]``); mean, variance and ``E H[p] = ψ(α₀+1) − Σ_k (α_k/α₀) ψ(α_k+1)``
      are the Dirichlet's.

    Posterior draws are made in chunks of at most 2²⁵ numbers, so memory does not grow with
    ``n_samples`` (one chunk when they fit: the same draws as ``la.sample(n_samples)``).

    Last-layer posteriors (laplace-torch's ``LLLaplace`` classes, :func:`lsn_ext.Laplace`'s
    ``subset_of_weights="last_layer"``): the logits are linear in the head, so ``"glm"`` and
    ``"nn"`` are the same distribution. One forward pass gives the head's features; each draw
    costs the head only (:mod:`lsn_ext.laplace_ext.head_posterior`), and for ``"glm"``
    ``logit_variance`` (and the covariance ``"bridge"`` uses) is exact, in closed form.
    ``window`` is refused for them.

    The model runs in its current mode. Normalisation layers with running statistics must be in
    eval mode (laplace-torch's ``fit`` leaves the model in eval mode); ``predict`` refuses
    training-mode batch norm rather than normalising with the batch's statistics, and never
    changes the model's mode, parameters or buffers.

    Args:
        la: A fitted laplace-torch ``Laplace`` object (any backend; :class:`DiagBackprop` tells
            binary from multi-class by its loss), or any other posterior over the model's
            trainable parameters (in ``parameters()`` order) with attributes ``model``,
            ``n_params``, ``mean`` (``[n_params]``, for ``"glm"``), ``link`` (``"softmax"``,
            ``"sigmoid"`` or ``"identity"``) and a method ``sample(n, generator=None) ->
            [n, n_params]`` (e.g. :mod:`lsn_ext.vi`; a mixture only with ``"nn"``).
        x: Images ``[N, C_in, *spatial]``, finite.
        n_samples: Posterior samples (the LSN paper uses 50), at least 2.
        pred_type: ``"glm"`` (linearised) or ``"nn"`` (sampling, the default).
        link_approx: ``"mc"`` (default), ``"probit"`` or ``"bridge"``; regression takes
            ``"mc"`` only (the maps are the output mean and variance).
        generator: Random generator for reproducible samples.
        window: Evaluate every draw by sliding-window inference over ``x``
            (:class:`~lsn_ext.SlidingWindow`, MONAI's blending; for volumes larger than one
            forward pass allows); the maps are those of the blended logits of each draw, see
            :mod:`lsn_ext.sliding`. A tuple of ints is the window size with the default
            settings (``window=(96, 96, 96)``). ``None``: the network runs on ``x`` whole.
        progress_bar: Show tqdm bars on stderr: one over the posterior draws (``"glm"``: over
            the antithetic pairs), and with ``window`` one over the window batches of the
            current pass. The maps are the same with and without.

    Returns:
        The predictive maps (:class:`SegmentationPrediction`), with ``logit_mean`` and
        ``logit_variance``.

    Raises:
        TypeError: If ``la`` is not a posterior or ``x`` not a tensor.
        ValueError: If ``la`` is not fitted, ``n_samples < 2``, ``x`` is empty or not finite,
            ``pred_type`` or ``link_approx`` is unknown, the model has training-mode batch
            norm, the logits are not ``[N, C, *]``, a softmax posterior has one logit channel
            (a BCE posterior created or loaded without ``backend_kwargs={"loss": "bce"}``), or
            the maps are not finite (a posterior too wide for the dtype).
    """
    check_fitted(la)
    check_n_samples(n_samples)
    check_choice("pred_type", pred_type, PRED_TYPES)
    check_choice("link_approx", link_approx, LINK_APPROXES)
    window = as_window(window)
    if isinstance(x, Mapping):
        x = dict_input(_network(la), x, la.dict_key_x, "predict")
    x = check_images(plain_tensor(x))
    link = link_of(la)
    if link == "identity" and link_approx != "mc":
        raise ValueError(
            f"link_approx={link_approx!r} approximates a softmax or sigmoid; a regression "
            "posterior's maps are the output mean and variance: use link_approx='mc'"
        )
    last_layer = is_last_layer(la)  # closed-form GLM predictive (laplace_ext.head_posterior)
    if last_layer and window is not None:
        raise ValueError(
            "window= is not supported for last-layer posteriors: their predictive is computed "
            "from the head's features of one forward pass; predict the volume in one pass"
        )
    named = [] if last_layer else trainable_params(la)
    model = _dist.unwrap(la.model)
    check_eval_norms(model, "predict")
    full = link_approx == "bridge" and link == "softmax"
    stats = _SampleMaps(link, full)
    with _Progress(progress_bar, pred_type, n_samples, window) as progress:
        if pred_type == "nn":
            if last_layer:
                draws = head_logit_draws(la, x, n_samples, generator)[1]
            else:
                draws = _nn_logits(la, model, named, x, n_samples, generator, progress.window)
            for f in progress.draws(draws):
                stats.add(_check_logits(f, link), logits=True)
            f_mean, f_second = stats.logits.mean, stats.logits.variance
        else:
            if last_layer:  # the logits are linear in the head: θ* ± δ are exact GLM draws
                f_mean, draws = head_logit_draws(la, x, (n_samples + 1) // 2, generator)
                tangents = (f - f_mean for f in draws)
            else:
                f_mean, tangents = glm_logits(
                    la, model, named, x, n_samples, generator, progress.window
                )
            _check_logits(f_mean, link)
            f_second, products = torch.zeros_like(_outer(f_mean) if full else f_mean), 0
            for t in progress.draws(tangents):
                products += 1
                f_second += _outer(t) if full else t * t
                stats.add(f_mean + t, logits=False)
                if stats.probs.count < n_samples:
                    stats.add(f_mean - t, logits=False)
            f_second /= products
            if last_layer:  # exact per-pixel (co)variance instead of its estimate
                f_second = head_logit_moments(la, x, covariance=full)[1]
    f_var = f_second.diagonal(dim1=1, dim2=2).movedim(-1, 1) if full else f_second
    mean, variance = stats.probs.mean, stats.probs.variance
    if link == "identity":
        if pred_type == "glm":
            mean, variance = f_mean, f_var
        result = SegmentationPrediction(
            mean, variance, None, None, n_samples, f_mean, f_var, pred_type, link_approx
        )
        return _check_maps(result, la)
    if link_approx == "probit":
        kappa = torch.rsqrt(1 + math.pi / 8 * f_var)
        mean = inverse_link(kappa * f_mean, link)
    expected_entropy = stats.entropy.mean
    if link_approx == "bridge":
        mean, variance, expected_entropy = _bridge_maps(link, f_mean, f_second)
    entropy = categorical_entropy(mean, link)
    mutual_information = (entropy - expected_entropy).clamp_min(0)
    result = SegmentationPrediction(
        mean,
        variance,
        entropy,
        mutual_information,
        n_samples,
        f_mean,
        f_var,
        pred_type,
        link_approx,
    )
    return _check_maps(result, la)


def _network(la: Any) -> nn.Module:
    """The network of a posterior: ``la.model``, or a last-layer posterior's wrapped network."""
    return la.model.model if is_last_layer(la) else la.model


def logit_draws(
    la: Any,
    x: Tensor,
    n_samples: int,
    *,
    pred_type: Literal["glm", "nn"] = "nn",
    generator: torch.Generator | None = None,
) -> Iterator[Tensor]:
    """The logits ``[N, C, *]`` at ``n_samples`` posterior draws, one tensor per draw.

    What :func:`predict` averages: ``"nn"``, the network at each draw; ``"glm"``, its
    linearisation at antithetic pairs ``f(x; θ*) ± J δ_s``; for a last-layer posterior the
    head at each draw (both: the logits are linear in the head). Checks the arguments at once.

    Args:
        la: A fitted posterior (laplace-torch ``Laplace`` or
            :class:`~lsn_ext.VariationalPosterior`).
        x: Inputs ``[N, C_in, *]`` (or a dictionary batch, see :func:`predict`).
        n_samples: Number of draws.
        pred_type: ``"nn"`` (default) or ``"glm"``.
        generator: Random generator of the draws.

    Returns:
        A lazy iterator over the ``n_samples`` logit maps ``[N, C, *]``, one per draw (one map
        in memory at a time); the arguments are checked before it is returned.

    Raises:
        ValueError: As :func:`predict`, for an unfitted posterior, bad options or inputs.
    """
    check_fitted(la)
    check_choice("pred_type", pred_type, PRED_TYPES)
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    if isinstance(x, Mapping):
        x = dict_input(_network(la), x, la.dict_key_x, "logit_draws")
    x = check_images(plain_tensor(x))
    check_eval_norms(_dist.unwrap(la.model), "logit_draws")
    if is_last_layer(la):
        return head_logit_draws(la, x, n_samples, generator)[1]
    named = trainable_params(la)
    model = _dist.unwrap(la.model)
    if pred_type == "nn":
        return _nn_logits(la, model, named, x, n_samples, generator)
    f_mean, tangents = glm_logits(la, model, named, x, n_samples, generator)

    def antithetic() -> Iterator[Tensor]:
        count = 0
        for t in tangents:
            for f in (f_mean + t, f_mean - t)[: n_samples - count]:
                count += 1
                yield f

    return antithetic()


def bridge_predictive(
    la: Any,
    x: Tensor,
    *,
    variance: Literal["linearized", "mc"] = "linearized",
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    norm: Norm = None,
    min_var: float | None = None,
) -> BridgeDirichlet:
    """Laplace-Bridge predictive of a fitted laplace-torch ``Laplace`` object.

    - ``[N, K]`` models: ``(f_mu, f_var)`` is laplace-torch's GLM predictive (full ``[N, K, K]``
      covariance, any backend and Hessian structure; ``la._glm_predictive_distribution``, the
      same call as ``la(x, link_approx=...)``), so the zero-sum projection is exact.
    - Segmentation ``[N, C, *]`` (``subset_of_weights="all"``, diagonal posterior, e.g. the
      :class:`~lsn_ext.DiagBackprop` backend): per-pixel diagonal variances. With
      ``variance="linearized"`` (default) from :func:`lsn_ext.linearized_variance` (one forward
      pass; like DB it drops covariances between activations and is **biased low on trained
      networks**, see the README), with ``variance="mc"`` the mean and variance of the logits
      over ``n_samples`` posterior samples (moment matching of the sampling predictive).
    - One logit channel (a BCE backend, sigmoid link): the logit ``f`` becomes the two logits
      ``[−f/2, f/2]`` with covariance ``[[v, −v], [−v, v]]/4`` (exact: its softmax is
      ``σ(f)``, and it is already zero-sum), so class 1 is the foreground.

    Args:
        la: A fitted laplace-torch ``Laplace`` object with a classification likelihood.
        x: Inputs ``[N, ...]``.
        variance: Per-pixel variance source for segmentation models (see above).
        n_samples: Posterior samples for ``variance="mc"``.
        generator: Random generator for ``variance="mc"``.
        norm: See :class:`~lsn_ext.bridge.LaplaceBridge`.
        min_var: See :class:`~lsn_ext.bridge.LaplaceBridge`.

    Returns:
        The :class:`~lsn_ext.bridge.BridgeDirichlet` (``probs``/``alpha`` in the logits'
        layout, ``[N, K, *]``).
    """
    check_fitted(la)
    trainable_params(la)  # a parameter frozen or unfrozen since the fit is named
    link = link_of(la)
    if link == "identity":
        raise ValueError("the Laplace Bridge needs a classification likelihood, not regression")
    if variance not in ("linearized", "mc"):
        raise ValueError(f"variance must be 'linearized' or 'mc', got {variance!r}")
    bridge = LaplaceBridge(norm=norm, min_var=min_var)
    with torch.no_grad():
        out_dim = la.model(x[:1]).dim()
    if out_dim == 2 and link == "softmax":
        f_mu, f_var = la._glm_predictive_distribution(x)
        return bridge(f_mu.detach(), f_var.detach())
    if is_last_layer(la):  # the head's exact per-pixel variances (closed form)
        f_mu, f_var = head_logit_moments(la, x)
    elif variance == "linearized":
        f_mu, f_var = linearized_variance(la.model, x, la.posterior_variance)
    else:
        if n_samples < 2:
            raise ValueError(f"n_samples must be at least 2, got {n_samples}")
        moments = predict(la, x, n_samples, generator=generator)
        f_mu, f_var = moments.logit_mean, moments.logit_variance
    if link == "sigmoid":
        if f_mu.shape[1] != 1:
            raise ValueError(f"a sigmoid link needs one logit channel, got {f_mu.shape[1]}")
        f_mu, f_var = sigmoid_as_softmax(f_mu, f_var)
        # A diagonal [v/4, v/4] would be projected to zero; the exact covariance has Σ1 = 0,
        # so use μ and diag Σ as they are.
        return LaplaceBridge(norm=norm, min_var=min_var, project=False)(f_mu, f_var)
    return bridge(f_mu, f_var)
