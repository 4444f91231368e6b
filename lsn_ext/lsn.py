"""Laplacian Segmentation Networks (Zepf et al. 2024): a Laplace posterior on an SSN's mean network.

The SSN (:class:`lsn_ext.models.SSN`) models aleatoric uncertainty with a low-rank Gaussian over
the logits. The LSN adds epistemic uncertainty with a diagonal Laplace approximation over the
**backbone and the mean head only**; the variance heads stay at ``θ_MAP`` (LSN Eq. 12). At zero
logit variance the SSN loss is the (binary) cross-entropy of the mean network, so the curvature
is the GGN of that loss, computed here by diagonal backpropagation
(:class:`lsn_ext.DiagBackprop`). With logit noise the SSN's own likelihood has a different
curvature w.r.t. ``μ``: ``fit_lsn(..., curvature="expected" | "logsumexp")`` uses it instead
(binary SSNs; derivation in :mod:`lsn_ext.rules.ssn_likelihood`).

Binary segmentation uses one logit channel with a sigmoid and the Bernoulli likelihood (the
``σ(η)`` of LSN Eq. 16–17); its curvature is that of :class:`lsn_ext.BCEWithLogits` with the same
``pos_weight`` as the SSN loss (1 by default: the paper finds that SSNs need no class
re-weighting, its Table 1). ``K ≥ 2`` classes use a softmax and cross-entropy.

Shape legend: ``N`` batch, ``K`` logit channels, ``H``/``W`` height and width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import tqdm
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lsn_ext import distributed as _dist
from lsn_ext._functional import functional_call_all, unflatten
from lsn_ext._laplace import BaseLaplace, Laplace
from lsn_ext._memory import check_sample_memory
from lsn_ext.estimators import Estimator
from lsn_ext.glm import sample_chunks
from lsn_ext.kron import KronLaplaceND
from lsn_ext.laplace_ext import (
    PRED_TYPES,
    DiagBackprop,
    SegmentationPrediction,
    check_before_laplace_fit,
    check_choice,
    check_images,
    check_n_samples,
    glm_logits,
    predict,
)
from lsn_ext.links import categorical_entropy, inverse_link, link_of_channels
from lsn_ext.lowrank import LowRankGGNLaplace
from lsn_ext.mixture import mixture_predict
from lsn_ext.models.ssn import SSN, SSNOutput
from lsn_ext.moments import RunningMoments
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy, Loss
from lsn_ext.rules.ssn_likelihood import ExpectedBCE, LogsumexpBCE

__all__ = [
    "CURVATURES",
    "LSNPrediction",
    "MeanNetwork",
    "aleatoric_maps",
    "ensemble_predict",
    "fit_lsn",
    "mc_dropout_predict",
    "mixture_predict",
    "predict_lsn",
]


@contextmanager
def _restored(*modules: nn.Module, grads: bool = False) -> Iterator[None]:
    """Restore every submodule's ``training`` flag (and optionally each ``.grad``) on exit.

    Saving one flag per submodule keeps mixed modes (e.g. an eval-mode SSN around a train-mode
    dropout) that a single ``module.train(mode)`` on the root would flatten. ``grads=True`` also
    puts back the ``.grad`` tensors of the parameters, which laplace-torch's ``fit`` clears with
    ``model.zero_grad()``.
    """
    modes = {m: m.training for module in modules for m in module.modules()}
    saved = {p: p.grad for module in modules for p in module.parameters()} if grads else {}
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        for p, g in saved.items():
            p.grad = g


Curvature = Literal["ce", "expected", "logsumexp"]
Structure = Literal["diag", "kron", "lowrank"]
STRUCTURES = get_args(Structure)
CURVATURES: tuple[str, ...] = ("ce", "expected", "logsumexp")


class _WithSSNTargets:
    """The training loader with targets that carry the SSN's covariance (``fit_lsn``).

    Batch ``i`` ``(x, y)`` becomes ``(x, pack(ssn.distribution(x), y, i))``, the distribution
    taken without gradients on the SSN's device; ``i`` restarts at 0 with every iteration
    (laplace-torch takes the first batch once more to size its output). ``dataset``,
    ``sampler`` and ``len`` are the loader's, which laplace-torch and :mod:`lsn_ext.distributed`
    read.
    """

    def __init__(
        self, loader: DataLoader, ssn: SSN, pack: Callable[[SSNOutput, Tensor, int], Tensor]
    ):
        self.loader, self.ssn, self.pack = loader, ssn, pack
        self.dataset = loader.dataset
        self.sampler = getattr(loader, "sampler", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        device = next(self.ssn.parameters()).device
        for i, batch in enumerate(self.loader):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(
                    f"fit_lsn needs (x, y) batches for curvature='expected'/'logsumexp', got a "
                    f"{type(batch).__name__}"
                )
            x, y = batch[0].to(device), batch[1].to(device)
            with torch.no_grad():  # not around the yield: the fit runs with gradients
                targets = self.pack(self.ssn.distribution(x), y, i)
            yield x, targets


def _curvature_loss(
    ssn: SSN,
    curvature: str,
    pos_weight: float,
    n_samples: int | None,
    seed: int | None,
    distributed: bool,
) -> tuple[Loss, Callable[[SSNOutput, Tensor, int], Tensor] | None]:
    """The loss of ``curvature`` and, unless ``"ce"``, how to pack each batch's targets."""
    if curvature not in CURVATURES:
        raise ValueError(f"unknown curvature {curvature!r}; use one of {CURVATURES}")
    if curvature != "logsumexp" and n_samples is not None:
        raise ValueError(
            f"curvature={curvature!r} draws no logit noise, but n_samples={n_samples!r}; "
            "n_samples is the number of draws M of curvature='logsumexp'"
        )
    if curvature == "ce":
        loss = BCEWithLogits(pos_weight=pos_weight) if ssn.num_classes == 1 else CrossEntropy()
        return loss, None
    if ssn.num_classes != 1:
        raise ValueError(
            f"curvature={curvature!r} supports binary SSNs (num_classes=1), this SSN has "
            f"{ssn.num_classes} classes: the expected C×C curvature block needs each pixel's "
            "K-dimensional logit marginal. Use curvature='ce' for multi-class SSNs"
        )
    if curvature == "expected":

        def pack_variance(output: SSNOutput, y: Tensor, _batch: int) -> Tensor:
            return ExpectedBCE.targets(output, y)

        return ExpectedBCE(pos_weight=pos_weight), pack_variance
    loss = LogsumexpBCE(pos_weight=pos_weight, n_samples=20 if n_samples is None else n_samples)
    rank = (_dist.world() or (0, 1))[0] if distributed else 0

    def pack_draws(output: SSNOutput, y: Tensor, batch: int) -> Tensor:
        generator = None
        if seed is not None:
            generator = torch.Generator(device=output.mean.device)
            generator.manual_seed(hash((seed, rank, batch)) & (2**63 - 1))
        return loss.targets(output, y, generator=generator)

    return loss, pack_draws


class MeanNetwork(nn.Module):
    """The mean network ``x ↦ μ(x)`` of an SSN, as a view that shares its modules.

    Its submodules are the SSN's own ``backbone`` and ``mean_head`` objects (no copies), so its
    parameters are exactly ``θ_mean`` of LSN Eq. 12, under the same names as in the SSN
    (``backbone.…``, ``mean_head.…``). Pass it to ``laplace.Laplace``; the SSN is not modified.

    Args:
        ssn: The trained SSN.
    """

    def __init__(self, ssn: SSN):
        super().__init__()
        if not isinstance(ssn, SSN):
            raise TypeError(f"MeanNetwork takes an lsn_ext.models.SSN, got {type(ssn).__name__}")
        self.backbone = ssn.backbone
        self.mean_head = ssn.mean_head

    def forward(self, x: Tensor) -> Tensor:
        """The SSN's logit mean ``μ(x)``.

        Args:
            x: Images ``[N, C_in, H, W]``.

        Returns:
            ``μ(x)``, ``[N, K, H, W]``.
        """
        return self.mean_head(self.backbone(x))


def fit_lsn(
    ssn: SSN,
    train_loader: DataLoader,
    *,
    pos_weight: float = 1.0,
    prior_precision: float = 1.0,
    progress_bar: bool = False,
    estimator: Estimator = "mc",
    mc_samples: int = 1,
    seed: int | None = 0,
    distributed: bool = True,
    curvature: Curvature = "ce",
    n_samples: int | None = None,
    hessian_structure: Structure = "diag",
    rank: int | None = None,
) -> BaseLaplace:
    """Fit the LSN posterior: a Laplace approximation over backbone + mean head.

    ``Laplace(MeanNetwork(ssn), "classification", subset_of_weights="all",
    hessian_structure="diag", backend=DiagBackprop)`` fitted on ``train_loader``, with the loss
    that ``curvature`` names (the paper's posterior). ``hessian_structure="kron"`` fits KFAC
    factors over the same weights instead (:class:`lsn_ext.kron.KronLaplaceND`, ``G`` from
    ``mc_samples`` draws of the same loss's Hessian square root), ``"lowrank"`` a low-rank +
    diagonal GGN from Lanczos on GGN-vector products (:class:`lsn_ext.lowrank.LowRankGGNLaplace`,
    ``rank`` eigenpairs, default 10). ``la.n_params`` equals the number of parameters of
    ``ssn.backbone`` and ``ssn.mean_head``. Tune the prior precision afterwards, e.g. with
    :func:`lsn_ext.gridsearch_prior_precision` or ``la.optimize_prior_precision``.

    The curvature w.r.t. the mean logits ``μ`` (per pixel, ``a = w₊ y + 1 − y``; derivation
    and accuracy in :mod:`lsn_ext.rules.ssn_likelihood`):

    - ``"ce"`` (default): the BCE (``K = 1``) or cross-entropy Hessian at ``μ``, ignoring the
      SSN's logit noise: ``a σ(μ)σ(−μ)``.
    - ``"expected"``: ``a E_{η ~ N(μ, v)} σ(η)σ(−η)`` with each pixel's marginal variance
      ``v = d + |P_s|²`` at ``θ_MAP``, the exact Hessian of the per-pixel expected NLL
      (:class:`~lsn_ext.rules.ssn_likelihood.ExpectedBCE`, deterministic quadrature).
    - ``"logsumexp"``: ``a Σ_m w_m σ(η^(m))σ(−η^(m))``, the PSD part of the Hessian of the SSN
      loss (LSN Eq. 11) with ``n_samples`` fixed antithetic draws ``η^(m) = μ + ε^(m)`` per
      image and importance weights ``w = softmax_m(log p(y | η^(m)))``
      (:class:`~lsn_ext.rules.ssn_likelihood.LogsumexpBCE`).

    For the last two each batch's targets are packed with the SSN's covariance for its images
    (``ssn.distribution(x)`` in eval mode, without gradients), and ``la.loss`` is that
    likelihood's negative log, summed over the data. They support binary SSNs (``K = 1``).

    Args:
        ssn: A trained SSN (left unchanged).
        train_loader: A ``DataLoader`` of ``(x, y)`` (laplace-torch reads its dataset's
            size): masks ``[N, 1, H, W]`` for ``K = 1``, class indices
            ``[N, H, W]`` otherwise.
        pos_weight: Foreground weight of the binary loss (as used to train the SSN).
        prior_precision: Initial prior precision.
        progress_bar: Show laplace-torch's tqdm bar on stderr over the training batches
            (``"diag"`` and ``"kron"``; the Lanczos fit of ``"lowrank"`` shows none). The
            posterior is the same with and without.
        estimator: The GGN-diagonal estimator (:func:`lsn_ext.ggn_diagonal`): ``"mc"``
            (default, unbiased Monte Carlo), ``"db"`` (the paper's diagonal backprop) or
            ``"db_calibrated"``.
        mc_samples: Monte-Carlo vectors per image for ``"mc"`` and ``"db_calibrated"``.
        seed: Seed of the Monte-Carlo vectors: each batch's vectors are a function of
            ``(seed, batch)``, so a refit reproduces the posterior (``None``: torch's global
            generator), see :class:`lsn_ext.DiagBackprop`.
        distributed: Under an initialised ``torch.distributed`` process group with more than
            one rank, sum the curvature over the ranks (each rank passes its shard's loader and
            gets the posterior of the whole data set; the rank is folded into ``seed``), see
            :mod:`lsn_ext.distributed`. A padding or dropping ``DistributedSampler`` is refused
            before the fit. ``False``: each rank fits its own shard.
        curvature: ``"ce"``, ``"expected"`` or ``"logsumexp"`` (see above).
        n_samples: Draws ``M`` per image for ``"logsumexp"`` (even; default 20, the paper's
            SSN loss). Batch ``i`` of a fit draws them from a generator seeded with
            ``hash((seed, rank, i))`` (``seed=None``: torch's global generator), so a refit on
            the same loader order reproduces the posterior. Refused for the other curvatures.
        hessian_structure: ``"diag"`` (default), ``"kron"`` or ``"lowrank"``.
        rank: Eigenpairs of ``"lowrank"`` (default 10); refused for the other structures.

    Returns:
        The fitted laplace-torch object; ``la.model`` is the :class:`MeanNetwork`.

    Raises:
        TypeError: If ``ssn`` is not an SSN or ``train_loader`` has no ``dataset``.
        ValueError: If the loader's dataset is empty, for a ``DistributedSampler`` that pads or
            drops samples (distributed fits), an unknown ``curvature``, ``"expected"`` or
            ``"logsumexp"`` for ``K ≥ 2``, ``n_samples`` that is not a positive even int or is
            given for another curvature, an unknown ``hessian_structure``, ``rank`` without
            ``"lowrank"``, and as :class:`lsn_ext.DiagBackprop`.
    """
    if not isinstance(ssn, SSN):
        raise TypeError(f"fit_lsn takes an lsn_ext.models.SSN, got {type(ssn).__name__}")
    if hessian_structure not in STRUCTURES:
        raise ValueError(
            f"hessian_structure must be one of {STRUCTURES}, got {hessian_structure!r}"
        )
    if rank is not None and hessian_structure != "lowrank":
        raise ValueError(
            f"rank is an option of hessian_structure='lowrank', not {hessian_structure!r}"
        )
    dataset = getattr(train_loader, "dataset", None)
    if dataset is None:
        raise TypeError(
            "train_loader must be a DataLoader (laplace-torch reads len(train_loader.dataset)), "
            f"got {type(train_loader).__name__}"
        )
    if len(dataset) == 0:
        raise ValueError("train_loader's dataset is empty: nothing to fit the posterior on")
    if distributed and _dist.world() is not None:
        _dist.check_loader(train_loader)
    mean_network = MeanNetwork(ssn)
    check_before_laplace_fit(mean_network, train_loader)
    loss, pack = _curvature_loss(ssn, curvature, pos_weight, n_samples, seed, distributed)
    options = {
        "backend": DiagBackprop,
        "backend_kwargs": {
            "loss": loss,
            "estimator": estimator,
            "mc_samples": mc_samples,
            "seed": seed,
            "distributed": distributed,
        },
        "prior_precision": prior_precision,
    }
    if hessian_structure == "kron":
        la = KronLaplaceND(mean_network, "classification", **options)
    elif hessian_structure == "lowrank":
        la = LowRankGGNLaplace(mean_network, "classification", rank=rank or 10, **options)
    else:
        la = Laplace(
            mean_network, "classification", subset_of_weights="all", hessian_structure="diag",
            **options,
        )  # fmt: skip
    # laplace-torch's fit calls model.eval() and model.zero_grad() on the MeanNetwork, i.e. on
    # the SSN's own backbone and mean head: put their modes and gradients back.
    with _restored(ssn, grads=True):
        if pack is not None:
            ssn.eval()
            train_loader = _WithSSNTargets(train_loader, ssn, pack)
        la.fit(train_loader, progress_bar=progress_bar)
    return la


def _probabilities(logits: Tensor, dim: int = 1) -> Tensor:
    """Probabilities of logits with classes on ``dim``: one channel is a sigmoid, more a softmax."""
    return inverse_link(logits, link_of_channels(logits.shape[dim]), dim)


def _sample_prediction(logit_samples: Iterator[Tensor], n_samples: int) -> SegmentationPrediction:
    """Mean, variance, entropy and mutual information of the probabilities of logit samples."""
    if n_samples < 2:
        raise ValueError(f"n_samples must be at least 2 to estimate a variance, got {n_samples}")
    stats, expected_entropy = RunningMoments(), RunningMoments(None)
    for f in logit_samples:
        link = link_of_channels(f.shape[1])
        p = inverse_link(f, link)
        stats.add(p)
        expected_entropy.add(categorical_entropy(p, link))
    entropy = categorical_entropy(stats.mean, link)
    return SegmentationPrediction(
        stats.mean,
        stats.variance,
        entropy,
        (entropy - expected_entropy.mean).clamp_min(0),
        n_samples,
    )


@torch.no_grad()
def mc_dropout_predict(model: nn.Module, x: Tensor, n_samples: int = 50) -> SegmentationPrediction:
    """Monte Carlo dropout (Gal and Ghahramani 2016): ``n_samples`` passes with dropout active.

    Only the dropout modules are switched to training mode (batch norm stays in eval mode);
    the model's modes are restored afterwards. Randomness comes from torch's global generator.

    Args:
        model: A network with ``nn.Dropout*`` modules, logits ``[N, K, H, W]`` (``K = 1``:
            sigmoid).
        x: Images ``[N, C_in, H, W]``.
        n_samples: Forward passes (the LSN paper: 50).

    Returns:
        The :class:`~lsn_ext.SegmentationPrediction` of the ``n_samples`` passes: mean and
        variance ``[N, K, H, W]``, entropy and mutual information ``[N, H, W]``.

    Raises:
        ValueError: If the model has no dropout module, ``x`` is empty or not finite, or
            ``n_samples < 2``.
    """
    x = check_images(x)
    check_n_samples(n_samples)
    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    if not any(m.p > 0 for m in dropouts):
        raise ValueError(f"{type(model).__name__} has no dropout module with p > 0")
    with _restored(model):
        model.eval()
        for m in dropouts:
            m.train()
        return _sample_prediction((model(x) for _ in range(n_samples)), n_samples)


@torch.no_grad()
def ensemble_predict(models: Iterable[nn.Module], x: Tensor) -> SegmentationPrediction:
    """Deep ensemble (Lakshminarayanan et al. 2017): one prediction per member, in eval mode.

    The members' modes are restored afterwards.

    A single member is refused, not answered with zero variance: the epistemic maps of an
    ensemble are the spread between its members, which one network does not have.

    Args:
        models: The members (at least two), each mapping ``x`` to logits ``[N, K, H, W]``
            (``K = 1``: sigmoid).
        x: Images ``[N, C_in, H, W]``.

    Returns:
        The :class:`~lsn_ext.SegmentationPrediction` over the members (mean, variance,
        entropy and mutual information maps).

    Raises:
        TypeError: If a member is not an ``nn.Module``.
        ValueError: For fewer than two members (naming the count) or an empty or non-finite
            ``x``.
    """
    models = list(models)
    if len(models) < 2:
        n = len(models)
        one = (
            ": one network has no spread between members, so its variance and mutual "
            "information are undefined. Train more members, or for one network's epistemic "
            "uncertainty fit a Laplace approximation (lsn_ext.predict) or use "
            "lsn_ext.lsn.mc_dropout_predict"
        )
        raise ValueError(
            "ensemble_predict needs at least 2 members to measure the spread between them; "
            f"got {n} member{'' if n == 1 else 's'}{one if n == 1 else ''}"
        )
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise TypeError(f"ensemble member {i} is a {type(m).__name__}, not an nn.Module")
    x = check_images(x)
    with _restored(*models):
        return _sample_prediction((m.eval()(x) for m in models), len(models))


@torch.no_grad()
def aleatoric_maps(
    ssn: SSN, x: Tensor, n_samples: int = 20, *, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Aleatoric maps: mean and variance of the probabilities over logit samples at ``θ_MAP``.

    ``η^(m) ~ N(μ(x), diag(d(x)) + P(x) P(x)ᵀ)``, ``m = 1…M``; returns ``E σ(η)`` and
    ``Var σ(η)`` per pixel (softmax over the classes for ``K ≥ 2``), each ``[N, K, H, W]``.
    The SSN is evaluated in eval mode (dropout off); its mode is restored.

    Args:
        ssn: The trained SSN.
        x: Images ``[N, C_in, H, W]``.
        n_samples: ``M``, the logit samples (the LSN paper: 20).
        generator: Random generator of the samples (on the SSN's device).

    Returns:
        ``(mean, variance)`` of the probabilities, each ``[N, K, H, W]``.

    Raises:
        TypeError: If ``ssn`` is not an SSN.
        ValueError: For ``n_samples < 2`` or an empty or non-finite ``x``.
    """
    if not isinstance(ssn, SSN):
        raise TypeError(f"aleatoric_maps takes an lsn_ext.models.SSN, got {type(ssn).__name__}")
    check_n_samples(n_samples)
    x = check_images(x)
    with _restored(ssn):
        ssn.eval()
        eta = ssn.distribution(x).rsample(n_samples, antithetic=False, generator=generator)
    stats = RunningMoments()
    stats.extend(_probabilities(eta, dim=2))
    return stats.mean, stats.variance


class _DistributionView(nn.Module):
    """``forward`` = ``ssn.distribution`` as tensors, so that ``functional_call`` can run it."""

    def __init__(self, ssn: SSN):
        super().__init__()
        self.ssn = ssn

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = self.ssn.distribution(x)
        return out.mean, out.cov_diag, out.cov_factor


@dataclass
class LSNPrediction:
    """Per-pixel maps of a Laplacian Segmentation Network (``[N, K, H, W]`` unless stated).

    Attributes:
        epistemic: Mean networks sampled from the posterior: ``E_θ σ(μ_θ)``, ``Var_θ σ(μ_θ)``
            (the epistemic map), entropy and mutual information (:func:`lsn_ext.predict`).
        aleatoric_mean: ``E_η σ(η)`` at ``θ_MAP``.
        aleatoric: ``Var_η σ(η)`` at ``θ_MAP`` (the aleatoric map).
        total_mean: ``E σ(η)`` with ``θ ~ q`` (backbone + mean head) and ``η ~ p(η | x, θ)``.
        total: ``Var σ(η)`` over the same joint samples.
        entropy: Predictive entropy of ``total_mean`` in nats, ``[N, H, W]``.
    """

    epistemic: SegmentationPrediction
    aleatoric_mean: Tensor
    aleatoric: Tensor
    total_mean: Tensor
    total: Tensor
    entropy: Tensor


@torch.no_grad()
def predict_lsn(
    la: BaseLaplace,
    ssn: SSN,
    x: Tensor,
    n_epistemic: int = 50,
    n_aleatoric: int = 20,
    *,
    seed: int = 0,
    pred_type: Literal["glm", "nn"] = "nn",
    progress_bar: bool = False,
) -> LSNPrediction:
    """Epistemic, aleatoric and total predictive maps of an LSN (the paper: 50 and 20 samples).

    The epistemic samples come from :func:`lsn_ext.predict` on ``la`` with ``pred_type``
    (parameters are passed with ``functional_call``; neither model is modified). The total maps
    reuse the same posterior draws (same seed), each with ``n_aleatoric`` logit samples:

    - ``"nn"``: for each ``θ``, the SSN with the sampled backbone and mean head and the MAP
      variance heads (fed by the sampled backbone).
    - ``"glm"``: the linearised mean network ``μ* + J(θ − θ*)`` (antithetic pairs, as in
      :func:`lsn_ext.predict`) with the logit covariance of the SSN at ``θ*``:
      ``η ~ N(μ* + J(θ − θ*), Σ*(x))``. Epistemic uncertainty enters through the mean only.

    Args:
        la: The posterior from :func:`fit_lsn`.
        ssn: The SSN whose mean network ``la`` was fitted on.
        x: Images ``[N, C_in, H, W]``.
        n_epistemic: Posterior samples of the mean network.
        n_aleatoric: Logit samples per parameter sample.
        seed: Seed of the samples.
        pred_type: ``"nn"`` (sampling, the default) or ``"glm"`` (linearised mean network).
        progress_bar: Show tqdm bars on stderr: :func:`lsn_ext.predict`'s over the epistemic
            draws, then one over the posterior draws of the total maps. The maps are the same
            with and without.

    Returns:
        The maps (:class:`LSNPrediction`); the SSN is evaluated in eval mode, its mode restored.

    Raises:
        TypeError: If ``la`` is not a laplace-torch ``Laplace``.
        ValueError: If ``la`` was not fitted on ``MeanNetwork(ssn)``, for sample counts below 2
            (naming the argument) or ``n_aleatoric`` logit samples beyond the device's memory,
            and an empty or non-finite ``x``.
    """
    if not isinstance(la, BaseLaplace):
        raise TypeError(f"la must be the Laplace object of fit_lsn, got {type(la).__name__}")
    if not isinstance(ssn, SSN):
        raise TypeError(f"predict_lsn takes an lsn_ext.models.SSN, got {type(ssn).__name__}")
    if not isinstance(la.model, MeanNetwork) or la.model.backbone is not ssn.backbone:
        raise ValueError("la must be the posterior of MeanNetwork(ssn) for this ssn (fit_lsn)")
    for name, value in (("n_epistemic", n_epistemic), ("n_aleatoric", n_aleatoric)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(
                f"{name} must be an int of at least 2 to estimate a variance, got {value!r}"
            )
    check_choice("pred_type", pred_type, PRED_TYPES)
    x = check_images(x)
    # The logit samples of one image batch, [n_aleatoric, N, K, *]: at least one class channel
    # at the input's resolution (the SSN's output size is known only after its forward pass).
    check_sample_memory(
        "n_aleatoric",
        n_aleatoric,
        x.shape[0] * x[0, 0].numel(),
        x,
        "use fewer logit samples per parameter sample (the LSN paper uses 20), or predict on "
        "fewer images at a time",
    )
    with _restored(ssn):
        ssn.eval()
        return _predict_lsn(la, ssn, x, n_epistemic, n_aleatoric, seed, pred_type, progress_bar)


def _nn_distributions(
    la: BaseLaplace, ssn: SSN, x: Tensor, n: int, generator: torch.Generator
) -> Iterator[SSNOutput]:
    """The SSN's logit distribution with backbone and mean head at ``n`` posterior draws."""
    named = [(n, p) for n, p in la.model.named_parameters() if p.requires_grad]
    view = _DistributionView(ssn)
    for chunk in sample_chunks(la.sample, n, la.n_params, generator):
        for theta in chunk:
            params = unflatten(named, theta, prefix="ssn.")
            yield SSNOutput(*functional_call_all(view, params, (x,)))


def _glm_distributions(
    la: BaseLaplace, ssn: SSN, x: Tensor, n: int, generator: torch.Generator
) -> Iterator[SSNOutput]:
    """``N(μ* ± J δ_s, Σ*(x))`` for ``⌈n/2⌉`` antithetic pairs of posterior draws (``n`` total)."""
    named = [(n, p) for n, p in la.model.named_parameters() if p.requires_grad]
    f_map, tangents = glm_logits(la, la.model, named, x, n, generator)
    at_map = ssn.distribution(x)
    count = 0
    for t in tangents:
        for sign in (1, -1):
            if count < n:
                count += 1
                yield SSNOutput(f_map + sign * t, at_map.cov_diag, at_map.cov_factor)


def _predict_lsn(
    la: BaseLaplace,
    ssn: SSN,
    x: Tensor,
    n_epistemic: int,
    n_aleatoric: int,
    seed: int,
    pred_type: str,
    progress_bar: bool,
) -> LSNPrediction:
    def gen(offset: int) -> torch.Generator:
        return torch.Generator(device=x.device).manual_seed(seed + offset)

    epistemic = predict(
        la, x, n_epistemic, pred_type=pred_type, generator=gen(0), progress_bar=progress_bar
    )
    aleatoric_mean, aleatoric = aleatoric_maps(ssn, x, n_aleatoric, generator=gen(1))
    draws = _glm_distributions if pred_type == "glm" else _nn_distributions
    eta_gen = gen(2)
    total = RunningMoments()
    bar = tqdm.tqdm(
        draws(la, ssn, x, n_epistemic, gen(0)),
        total=n_epistemic,
        desc="predict_lsn: total maps",
        unit="draw",
        disable=not progress_bar,
    )
    with bar:
        for distribution in bar:
            eta = distribution.rsample(n_aleatoric, antithetic=False, generator=eta_gen)
            total.extend(_probabilities(eta, dim=2))
    link = link_of_channels(ssn.num_classes)
    return LSNPrediction(
        epistemic,
        aleatoric_mean,
        aleatoric,
        total.mean,
        total.variance,
        categorical_entropy(total.mean, link),
    )
