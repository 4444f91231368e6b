"""laplace-torch integration: the ``DiagBackprop`` backend and per-pixel predictives.

``Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag",
backend=DiagBackprop)`` fits a diagonal Laplace approximation whose GGN diagonal comes from
the native engine (:func:`lsn_ext.ggn_diagonal`: Monte Carlo by default, or diagonal
backpropagation), linear in the number of pixels, for models whose logits are
``[N, C, *spatial]`` as well as ``[N, K]``.

Binary segmentation: laplace-torch has no Bernoulli likelihood. Ask for it explicitly through the
backend, ``backend_kwargs={"loss": lsn_ext.BCEWithLogits(pos_weight=...)}`` (or ``"bce"``), with
``likelihood="classification"`` and one logit channel ``[N, 1, *]``. The loss reported to
laplace-torch (and so its log likelihood and marginal likelihood), the curvature and
:func:`predict` (sigmoid link) then all use the same Bernoulli model. laplace-torch's
``state_dict`` does not record the backend's loss: load a BCE posterior into a ``Laplace``
created with the same ``backend_kwargs``. :func:`predict` refuses a softmax over one logit
channel (constant 1), which is what a BCE posterior loaded without its loss would give.

laplace-torch's own predictive (``la(x)``) assumes ``[batch, outputs]`` and a softmax link: the
backend's ``jacobians`` refuses spatial outputs and BCE models with a pointer to :func:`predict`,
so the GLM predictive and laplace-torch's validation grid search fail loudly instead of mixing
pixels and classes or returning 1 everywhere. ``la(x, pred_type="nn")`` does not go through the
backend (it cannot be intercepted) and takes the softmax over the *last* axis; do not use it for
segmentation or BCE models. :func:`predict` and :func:`gridsearch_prior_precision` are the
per-pixel equivalents.

Dense regression: laplace-torch counts only the last output axis in the Gaussian normaliser of
its log likelihood (``n_outputs = W`` for ``[N, C, H, W]``), so the backend refuses regression
outputs with more than two axes; flatten them in the model (``nn.Sequential(net,
nn.Flatten())``, targets ``[N, C·H·W]``) and the normaliser counts every output.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import tqdm
from torch import Tensor, nn

from lsn_ext import distributed as _dist
from lsn_ext._fingerprint import fingerprint
from lsn_ext._functional import functional_call_all, unflatten
from lsn_ext._laplace import (
    BaseLaplace,
    CurvatureInterface,
    GGNInterface,
    fix_prior_prec_structure,
)
from lsn_ext._laplace import (
    baselaplace as _laplace_module,
)
from lsn_ext.estimators import Estimator, check_estimator, ggn_diagonal
from lsn_ext.glm import linearized_tangents, sample_chunks
from lsn_ext.outputs import SelectInput, plain_tensor
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss, as_loss
from lsn_ext.sliding import SlidingWindow, as_window

__all__ = [
    "DiagBackprop",
    "GridSearchResult",
    "SegmentationPrediction",
    "gridsearch_prior_precision",
    "predict",
]

# The fit methods of laplace-torch's Laplace classes (see DiagBackprop._track_fit).
_FIT_CODES = frozenset(
    cls.fit.__code__
    for cls in vars(_laplace_module).values()
    if isinstance(cls, type) and issubclass(cls, BaseLaplace) and "fit" in vars(cls)
)

_NORMS_WITH_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _tensor_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, for hashing (no copy for a contiguous tensor)."""
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


# (prime p, multiplier a, offset b) of the two 31-bit sums of batch_digest.
DIGEST_LCGS = ((2_147_483_647, 1_103_515_245, 12_345), (2_147_483_629, 1_664_525, 1_013_904_223))
DIGEST_LCGS_CHUNK = 2**22  # words per step: bounds the int64 temporaries to 32 MiB each


def batch_digest(t: Tensor) -> Tensor:
    """Two 31-bit fingerprints of ``t``'s bytes, computed on its device: int64 ``[2]``.

    The bytes are read as 32-bit words (16- or 8-bit words for narrower dtypes); word ``u_i``
    contributes ``((u_i + a·i + b) mod p)² mod p``, summed mod ``p``, for two primes ``p`` just
    below 2³¹ (words that agree mod one prime differ mod the other). Every intermediate fits in
    int64 and integer sums are exact, so the result does not depend on the reduction order: it
    is the same on every run and device, and only these two numbers need reach the host. (On
    the CPU, where the bytes are at hand, hashing them is cheaper: see ``_batch_generator``.)
    """
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    words = flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)
    sums = []
    for p, a, b in DIGEST_LCGS:
        acc = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), DIGEST_LCGS_CHUNK):
            u = words[start : start + DIGEST_LCGS_CHUNK].long()
            i = torch.arange(start, start + u.numel(), device=u.device)
            if start + u.numel() > p:
                i = i % p
            x = (u + a * i + b) % p
            acc = (acc + (x * x % p).sum()) % p
        sums.append(acc)
    return torch.stack(sums)


def _check_finite(name: str, t: Tensor) -> None:
    """Raise a ``ValueError`` if a floating-point ``t`` holds NaN or infinite values."""
    if (t.is_floating_point() or t.is_complex()) and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} holds {bad} NaN or infinite value(s); "
            "clean or mask them before calling"
        )


def _dict_input(model: nn.Module, batch: Mapping[str, Any], key: str, who: str) -> Tensor:
    """The images ``batch[key]`` of a dictionary batch for a ``SelectInput(model, key)``.

    Raises:
        ValueError: If the model is not a ``SelectInput`` (laplace-torch passes dictionaries
            whole to the model, which the engines cannot split into samples), its key differs
            from ``key``, or the batch lacks ``key``.
    """
    keys = sorted(map(str, batch))
    if not isinstance(model, SelectInput):
        raise ValueError(
            f"{who} got a dictionary batch (keys {keys}) for a {type(model).__name__}, which "
            "takes it whole; the curvature and predictives run the model on one image tensor. "
            "Wrap the network: Laplace(lsn_ext.SelectInput(net, 'image'), ..., "
            "dict_key_x='image', dict_key_y='label') (MONAI's keys), or give (x, y) batches"
        )
    if model.key != key:
        raise ValueError(
            f"SelectInput takes the key {model.key!r} but dict_key_x is {key!r}: give "
            f"Laplace(..., dict_key_x={model.key!r}) (or SelectInput(net, {key!r}))"
        )
    if key not in batch:
        raise ValueError(f"the batch has no key dict_key_x={key!r} (keys: {keys})")
    return batch[key]


def check_images(x: Any, name: str = "x") -> Tensor:
    """``x`` if it is a finite tensor ``[N, …]`` with ``N ≥ 1``; otherwise a clear error.

    Raises:
        TypeError: If ``x`` is not a tensor.
        ValueError: If ``x`` has no batch axis, an empty batch or NaN/inf values.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor [N, C_in, *spatial], got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty batch [N, ...], got shape {tuple(x.shape)}")
    _check_finite(name, x)
    return x


def _check_eval_norms(model: nn.Module, what: str) -> None:
    """Refuse normalisation layers with running statistics in training mode."""
    for path, module in model.named_modules():
        if isinstance(module, _NORMS_WITH_STATS) and module.training and module.track_running_stats:
            raise ValueError(
                f"{what} needs the model in eval mode, but {path or '<root>'} "
                f"({type(module).__name__}) is in training mode: it would normalise with the "
                "batch's statistics (and training-mode statistics are not what the posterior was "
                "fitted with). Call model.eval() first; lsn_ext never changes the model's mode"
            )


def _check_trainable(model: nn.Module) -> None:
    """Refuse a model without parameters, or with every parameter frozen, naming which."""
    tensors = list(model.parameters())
    if not tensors:
        raise ValueError(
            f"{type(model).__name__} has no parameters at all: there are no weights to put a "
            "Laplace approximation on (a network with learnable layers is needed)"
        )
    if not any(p.requires_grad for p in tensors):
        raise ValueError(
            f"all {len(tensors)} parameter tensors of {type(model).__name__} are frozen "
            "(requires_grad=False): the posterior is over the parameters with requires_grad=True, "
            "and there are none. Unfreeze the ones it should cover (model.requires_grad_(True), "
            "or only some layers for a subnetwork Laplace)"
        )


def check_before_laplace_fit(model: nn.Module, train_loader: Any) -> None:
    """Errors that laplace-torch's ``fit`` raises before any backend runs, made clear.

    laplace-torch builds its backend lazily, on the first batch, after ``fit`` has already
    flattened the trainable parameters with ``parameters_to_vector`` (``torch.cat`` of nothing
    for a frozen model, ``.view(-1)`` of a channels_last weight) and taken ``next(iter(
    train_loader))`` (``StopIteration`` for a loader without batches): ``DiagBackprop`` cannot
    intercept these. lsn_ext's own entry points that call ``fit`` check them first with this.

    Raises:
        ValueError: For a model without trainable parameters, a trainable parameter that is
            not contiguous (channels_last), or a loader of length 0.
    """
    _check_trainable(model)
    for name, p in model.named_parameters():
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(
                f"parameter {name} {tuple(p.shape)} is not contiguous (a channels_last model?): "
                "laplace-torch's fit flattens the parameters with .view(-1), which fails on it "
                "('view size is not compatible'). Fit with "
                "model.to(memory_format=torch.contiguous_format); convert back afterwards if "
                "you like (lsn_ext.predict runs on either memory format)"
            )
    if hasattr(train_loader, "__len__") and len(train_loader) == 0:
        dataset = getattr(train_loader, "dataset", None)
        what = f"its dataset has {len(dataset)} samples" if dataset is not None else "empty"
        raise ValueError(
            f"train_loader yields no batches ({what}, batch_size="
            f"{getattr(train_loader, 'batch_size', None)}, drop_last="
            f"{getattr(train_loader, 'drop_last', None)}): nothing to fit the posterior on "
            "(laplace-torch's fit would raise a bare StopIteration). Use a smaller batch size "
            "or drop_last=False"
        )


def _resolve_estimator(
    estimator: Estimator | None,
    mc_samples: int | None,
    stochastic: bool | None,
    num_samples: int | None,
) -> tuple[str, int]:
    """``(estimator, mc_samples)`` from lsn_ext's and laplace-torch's names, or a clear error.

    laplace-torch's ``GGNInterface`` options ``stochastic``/``num_samples`` are mapped to
    ``estimator``/``mc_samples``; contradictory combinations are refused.
    """
    if stochastic is not None and not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be a bool, got {stochastic!r}")
    if stochastic is False:
        if estimator is None:
            raise ValueError(
                "stochastic=False asks laplace-torch for the exact GGN, which DiagBackprop does "
                "not compute. For its deterministic approximation (diagonal backprop) pass "
                "estimator='db' instead; for the exact GGN use laplace-torch's CurvlinopsGGN"
            )
        if estimator != "db":
            raise ValueError(
                f"stochastic=False contradicts estimator={estimator!r}, which draws Monte-Carlo "
                "vectors; leave stochastic out, or use estimator='db' (deterministic)"
            )
    if stochastic is True and estimator == "db":
        raise ValueError(
            "stochastic=True contradicts estimator='db' (deterministic diagonal backprop); "
            "use estimator='mc' or 'db_calibrated', or leave stochastic out"
        )
    estimator = "mc" if estimator is None else estimator
    if num_samples is not None:
        if mc_samples is not None and mc_samples != num_samples:
            raise ValueError(
                f"num_samples={num_samples!r} (laplace-torch's name) and "
                f"mc_samples={mc_samples!r} disagree; give one of them"
            )
        mc_samples = num_samples
    if estimator == "db" and mc_samples not in (None, 1):
        raise ValueError(
            f"estimator='db' draws no Monte-Carlo vectors, but mc_samples/num_samples="
            f"{mc_samples!r}; use estimator='mc' or 'db_calibrated' for sampled curvature"
        )
    mc_samples = 1 if mc_samples is None else mc_samples
    check_estimator(estimator, mc_samples, 0.0)
    return estimator, mc_samples


class DiagBackprop(GGNInterface):
    """laplace-torch backend for segmentation networks: GGN diagonals linear in the pixels.

    The curvature comes from the native engine, by unbiased Monte Carlo (default) or by
    diagonal backpropagation (``estimator="db"``, the LSN paper's method), see ``estimator``.

    Use it with ``hessian_structure="diag"`` and ``subset_of_weights="all"`` (or a subnetwork
    Laplace, whose indices it honours). ``H`` is ``Σ_batches`` of :func:`lsn_ext.ggn_diagonal`
    (Monte Carlo unless ``estimator`` says otherwise) with laplace-torch's conventions: losses
    summed over the data, the regression loss ``½ Σ (f − y)²`` (Hessian 1, scaled by
    laplace-torch with ``1/σ²``).

    Reproducibility: by default (``seed=0``) the Monte-Carlo vectors of a batch are a
    deterministic function of ``(seed, the batch's inputs and targets)``: a hash of their bytes
    (on the CPU) or of a fingerprint of them computed on their device (on an accelerator: no
    copy of the batch to the host, four integers come back) seeds a fresh generator per batch on
    the batch's device. CPU and CUDA generators differ, so the vectors (not their distribution)
    depend on the device too. A refit on the same data gives the same ``H`` (on CUDA up to the
    rounding of its non-deterministic sums, unless ``torch.use_deterministic_algorithms(True)``),
    three online fits ``fit(loader, override=False)`` give three times the ``H`` of one, and the
    result does not depend on torch's global random state; different batches (and different
    seeds) still get different vectors. ``seed=None`` draws from torch's global generator
    instead (a refit then differs).

    Data-parallel fits (``torchrun``, see :mod:`lsn_ext.distributed`): when ``torch.distributed``
    is initialised with more than one rank, ``diag`` all-reduces (sums) each batch's curvature
    and loss, so every rank ends with the ``H``, ``loss`` and ``n_data`` of a single-process fit
    over all shards. Every rank must then make the same number of ``diag`` calls, and the ranks
    must see each sample once per fit (no padded ``DistributedSampler``; per-rank datasets via
    :class:`lsn_ext.distributed.ShardedLoader`). The rank is folded into the Monte-Carlo seed, so
    ranks never share vectors, even for identical batches. A DDP-wrapped model is unwrapped (the
    curvature runs on ``model.module``).

    **What laplace-torch's ``fit`` does to the model** (its own code, before and around this
    backend, which cannot undo it): ``la.fit`` calls ``model.eval()`` and leaves the model in eval
    mode (batch norm included), calls ``model.zero_grad()`` before every batch (``.grad`` is
    ``None`` afterwards) and sets ``model.output_size``. laplace-torch creates the backend lazily,
    on the first batch, after ``model.eval()``, so the backend never sees the modes or gradients
    as they were. Keep what you need before the call::

        was_training = model.training
        la.fit(train_loader)
        model.train(was_training)

    (per-module modes: save ``{m: m.training for m in model.modules()}`` and restore each).
    ``la(x, pred_type="nn")`` loads every posterior sample into the model and finally
    ``la.mean`` with ``vector_to_parameters``, which leaves the parameters' data as views into
    ``la.mean``: training the model afterwards changes the posterior mean too. Detach them with
    ``torch.nn.utils.vector_to_parameters(la.mean.clone(), la.params)``. lsn_ext's own entry
    points (:func:`predict`, :func:`gridsearch_prior_precision`, :func:`lsn_ext.lsn.fit_lsn`,
    ...) leave the model as they found it.

    Errors laplace-torch raises before the backend exists (so not this backend's messages): a
    model whose parameters are all frozen (``torch.cat(): expected a non-empty list of
    Tensors``) or that has none (``StopIteration``), a loader without batches
    (``StopIteration``), a channels_last model (``view size is not compatible``; fit with
    ``model.to(memory_format=torch.contiguous_format)``), ``subset_of_weights="last_layer"`` on
    a network without a final ``nn.Linear`` (``Use model with a linear last layer.``) and
    ``hessian_structure="lowrank"`` (``ImportError`` asking for asdfghjkl). See the README.

    Args:
        model: The network; any ``nn.Module`` the native engine supports, run on tensor inputs.
        likelihood: ``"classification"`` or ``"regression"`` (given by laplace-torch).
            Regression outputs must be ``[N, K]``: see the module documentation.
            ``Laplace(..., "reward_modeling")`` works as with laplace-torch's own backends: it
            builds the backend with ``"classification"`` (the fit's logits are the ``[N, 2]``
            rewards of preference pairs) and predicts rewards as a regression, which
            :func:`predict` follows (identity link). Reward models reshape after their head,
            so use the default Monte-Carlo estimator (or ``ce_first_step="diag"`` with
            ``estimator="db"``, whose exact first step needs the head to be the last operation).
        last_layer: Must be false: for last-layer Laplace the built-in backends are exact.
        subnetwork_indices: Set by laplace-torch's subnetwork Laplace.
        dict_key_x: laplace-torch's key of the inputs in dictionary batches (MONAI:
            ``"image"``). laplace-torch passes the whole dictionary to the model, so the model
            must be a :class:`~lsn_ext.SelectInput` with this key; the curvature then runs on
            the tensor ``batch[dict_key_x]``. Other models are refused for dictionary batches.
        dict_key_y: laplace-torch's key of the targets in dictionary batches (MONAI:
            ``"label"``; laplace-torch takes them out of the batch).
        loss: The likelihood's loss, summed over the data: ``"ce"`` (default for
            classification), ``"bce"`` / :class:`~lsn_ext.BCEWithLogits` for binary
            segmentation with one logit channel, ``"mse"`` (regression), or a
            :class:`~lsn_ext.Loss`. Pass it as ``backend_kwargs={"loss": ...}``.
        ce_first_step: ``"exact"`` (default) or ``"diag"``, see :func:`lsn_ext.diag_backprop`.
        estimator: How each batch's GGN diagonal is estimated (:func:`lsn_ext.ggn_diagonal`):
            ``"mc"`` (default: unbiased Monte Carlo, about 2× a training step; its noise
            averages out over the batches of a fit), ``"db"`` (diagonal backprop, the LSN
            paper's method: deterministic, one backward pass, but 10–10⁶× too small below the
            last layers of trained networks, which breaks marginal-likelihood prior tuning) or
            ``"db_calibrated"`` (DB rescaled per parameter tensor to Monte-Carlo traces, per
            batch).
        mc_samples: Monte-Carlo vectors per sample for ``"mc"`` and ``"db_calibrated"``
            (default 1; ``"db"`` draws none).
        shrinkage: Weight of the Monte-Carlo estimate in ``"db_calibrated"``, in ``[0, 1]``.
        seed: Seed of the per-batch Monte-Carlo vectors (see above); ``None`` uses torch's
            global generator.
        stochastic: laplace-torch's name (``GGNInterface``): ``True`` is a Monte-Carlo
            curvature (``estimator="mc"`` unless ``"db_calibrated"`` is given); ``False`` asks
            for the exact GGN, which this backend does not compute, and is refused unless
            ``estimator="db"`` is given too. Read back, :attr:`stochastic` says whether the
            estimator draws random vectors.
        num_samples: laplace-torch's name for ``mc_samples``.
        distributed: Sum the curvature over the ranks of an initialised ``torch.distributed``
            process group (default). ``False``: each rank keeps its own shard's posterior.

    Raises:
        ValueError: For ``last_layer=True``, a model without parameters or with all of them
            frozen (message says which), a loss that does not match the likelihood, a
            loss with ``reduction="mean"``, an unknown estimator, bad estimator options or
            contradictory ``stochastic``/``num_samples``/``estimator``/``mc_samples``.
        TypeError: For a ``seed`` that is not an int or ``None``, or a non-bool
            ``distributed``.

    For the misuses laplace-torch's own backends also meet (an unknown likelihood, unknown
    options, dictionary batches without ``dict_key_x``/``dict_key_y``, non-tensor inputs, targets
    of the wrong shape, dtype or range) the errors have the types those backends raise
    (``tests/test_laplace_error_types.py``): target errors are lsn_ext's ``ValueError`` and
    also torch's ``RuntimeError`` (shape, dtype) or ``IndexError`` (class out of range), see
    :class:`~lsn_ext.rules.losses.TargetShapeError`.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        loss: str | Loss | nn.Module | None = None,
        ce_first_step: Literal["exact", "diag"] = "exact",
        estimator: Estimator | None = None,
        mc_samples: int | None = None,
        shrinkage: float = 0.0,
        seed: int | None = 0,
        stochastic: bool | None = None,
        num_samples: int | None = None,
        distributed: bool = True,
    ):
        if last_layer:
            raise ValueError(
                "DiagBackprop does not support subset_of_weights='last_layer': use 'all' (or a "
                "subnetwork), or laplace-torch's own backends, which are exact for the last layer"
            )
        # GGNInterface.__init__ would store ``stochastic``/``num_samples``; here they are
        # read-only views of the estimator, so initialise the base interface directly.
        model = _dist.unwrap(model)
        _check_trainable(model)
        CurvatureInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y
        )
        if loss is None:
            loss = "mse" if likelihood == "regression" else "ce"
        self.loss_fn = as_loss(loss)
        if self.loss_fn.reduction != "sum":
            raise ValueError(
                "laplace-torch sums the loss over the data: give the loss with reduction='sum'"
            )
        regression = isinstance(self.loss_fn, MSE)
        if regression != (likelihood == "regression"):
            raise ValueError(
                f"loss {type(self.loss_fn).__name__} does not fit likelihood={likelihood!r}: use "
                "MSE for 'regression' and cross-entropy or BCE for 'classification'"
            )
        if ce_first_step not in ("exact", "diag"):
            raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
        self.ce_first_step = ce_first_step
        estimator, mc_samples = _resolve_estimator(estimator, mc_samples, stochastic, num_samples)
        check_estimator(estimator, mc_samples, shrinkage)
        self.estimator, self.mc_samples, self.shrinkage = estimator, mc_samples, shrinkage
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        if not isinstance(distributed, bool):
            raise TypeError(f"distributed must be a bool, got {distributed!r}")
        self.distributed = distributed
        self._seen = 0  # samples summed over the ranks in the current fit
        self._checked_output: tuple | None = None  # fingerprint of the model last checked
        self._fit: list[int] | None = None  # [id of laplace-torch's fit frame, batches left]
        self.factor = 1.0
        self.lossfunc = self.loss_fn.value

    @property
    def stochastic(self) -> bool:
        """Whether the estimator draws random vectors (``"mc"``, ``"db_calibrated"``)."""
        return self.estimator != "db"

    @property
    def num_samples(self) -> int:
        """laplace-torch's name for :attr:`mc_samples`."""
        return self.mc_samples

    def _tensor_input(self, x: Tensor | Mapping[str, Any]) -> Tensor:
        if isinstance(x, Mapping):
            x = _dict_input(self.model, x, self.dict_key_x, "DiagBackprop")
        if not isinstance(x, Tensor):
            raise TypeError(f"DiagBackprop takes tensor inputs, got {type(x).__name__}")
        return plain_tensor(x)

    def _batch_generator(self, x: Tensor, y: Tensor) -> torch.Generator | None:
        """A generator seeded by ``(seed, x, y)``; ``None`` (global generator) for ``seed=None``."""
        if self.seed is None:
            return None
        digest = hashlib.blake2b(str(self.seed).encode(), digest_size=8)
        ranks = self._world()
        if ranks is not None:
            # Independent vectors per rank (identical batches on two ranks included).
            digest.update(f"rank {ranks[0]} of {ranks[1]}".encode())
        on_cpu = x.device.type == "cpu" and y.device.type == "cpu"
        for t in (x, y):
            digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
            if on_cpu:
                digest.update(_tensor_bytes(t))
        if not on_cpu:  # fingerprints computed on the device: no copy of the batch to the host
            fingerprints = torch.stack([batch_digest(x), batch_digest(y).to(x.device)]).tolist()
            digest.update(repr(fingerprints).encode())
        batch_seed = int.from_bytes(digest.digest(), "little") & (2**63 - 1)
        return torch.Generator(device=x.device).manual_seed(batch_seed)

    def _world(self) -> tuple[int, int] | None:
        """``(rank, world_size)`` if ``diag`` reduces over the ranks, else ``None``."""
        return _dist.world() if self.distributed else None

    def _reduce(self, loss: Tensor, H: Tensor, batch: int, N: int | None) -> tuple[Tensor, Tensor]:
        """Sum a batch's loss and curvature over the ranks and check the sample counts.

        Two collectives per batch: the range of ``N`` over the ranks (it must agree), then the
        sum of ``[H, loss, batch size]``. Every check depends on reduced values only, so all
        ranks raise together instead of leaving one blocked in the next all-reduce.
        """
        rank, size = _dist.world() or (0, 1)
        device = _dist.collective_device(H)
        last_batch = self._track_fit(device) if N is not None else False
        if N is not None:
            ((lo, hi),) = _dist.all_reduce_range([N], device)
            if lo != hi:
                self._seen = 0
                raise ValueError(
                    f"rank {rank}: laplace-torch reports len(train_loader.dataset)={N} here, but "
                    f"it ranges over {lo}..{hi} across the {size} ranks. Give every rank a "
                    "DistributedSampler over the full data set, or wrap per-rank loaders in "
                    "lsn_ext.distributed.ShardedLoader"
                )
        loss = torch.as_tensor(loss, device=H.device)
        extra = torch.stack([loss.to(H.dtype).reshape(()), H.new_tensor(float(batch))])
        total = _dist.all_reduce_sum(torch.cat([H.reshape(-1), extra]))
        H, loss = total[:-2].view_as(H), total[-2].to(loss.dtype)
        if N is not None:
            self._seen += round(float(total[-1]))
            if self._seen > N:
                seen, self._seen = self._seen, 0
                raise ValueError(
                    f"rank {rank}: the {size} ranks have together fitted {seen} samples, more "
                    f"than len(train_loader.dataset)={N} (laplace-torch's n_data). Either a "
                    "DistributedSampler pads the shards by repeating samples (drop_last=False "
                    f"with a data set size not divisible by {size}; see "
                    "lsn_ext.distributed.check_loader), or each rank's loader has its own "
                    "dataset (wrap it in lsn_ext.distributed.ShardedLoader), or an earlier fit "
                    "stopped short of N samples (drop_last=True). Pass "
                    "backend_kwargs={'distributed': False} for per-rank posteriors"
                )
            if last_batch and self._seen != N:
                seen, self._seen = self._seen, 0
                raise ValueError(
                    f"rank {rank}: the {size} ranks have together fitted {seen} samples, but "
                    f"len(train_loader.dataset)={N} (laplace-torch's n_data) counts {N}: the "
                    "curvature of the others would be missing. A DistributedSampler with "
                    f"drop_last=True drops samples when {N} is not divisible by {size} (see "
                    "lsn_ext.distributed.check_loader); per-rank datasets need "
                    "lsn_ext.distributed.ShardedLoader"
                )
            if last_batch or (self._fit is None and self._seen == N):
                self._seen = 0
        return loss, H

    def _track_fit(self, device: torch.device) -> bool:
        """Follow laplace-torch's ``fit`` that called ``diag``; whether this is its last batch.

        The backend cannot otherwise tell where a fit starts and ends. It finds the ``fit``
        frame of laplace-torch's classes on the call stack (by code object) and reads its
        ``train_loader``. On a fit's first batch it resets the sample counter and checks, with
        one collective, that every rank has the same number of batches (a rank with more
        would wait forever; one with fewer would return a posterior missing the others'
        curvature). Outside ``fit`` (direct ``diag`` calls) nothing is tracked.
        """
        frame = sys._getframe(2)
        while frame is not None and frame.f_code not in _FIT_CODES:
            frame = frame.f_back
        if frame is None:
            self._fit = None
            return False
        loader = frame.f_locals.get("train_loader")
        batches = len(loader) if hasattr(loader, "__len__") else None
        if self._fit is None or self._fit[0] != id(frame) or self._fit[1] <= 0:
            self._seen = 0
            self._fit = [id(frame), batches if batches is not None else -1]
            _dist.check_loader(loader)
            if batches is not None:
                ((lo, hi),) = _dist.all_reduce_range([batches], device)
                if lo != hi:
                    rank, size = _dist.world() or (0, 1)
                    self._fit = None
                    raise ValueError(
                        f"rank {rank}: this rank's train_loader has {batches} batches, but the "
                        f"{size} ranks have between {lo} and {hi}. Every batch is all-reduced, so "
                        "every rank needs the same number: use the same batch size on every "
                        "rank with a DistributedSampler, or equal shards in ShardedLoader"
                    )
        self._fit[1] -= 1
        return self._fit[1] == 0

    def _check_output(self, x: Tensor) -> None:
        """Refuse outputs laplace-torch would mishandle; again whenever the model changed.

        One forward pass of one sample, repeated only where the model's
        :func:`~lsn_ext._fingerprint.fingerprint` differs from the last checked one (a head
        swapped or wrapped between two fits).
        """
        state = fingerprint(list(self.model.modules()))
        if state == self._checked_output:
            return
        with torch.no_grad():
            out = self.model(x[:1])
        if not isinstance(out, Tensor):
            raise TypeError(
                f"the model returns a {type(out).__name__}; DiagBackprop needs one logit tensor"
            )
        if self.likelihood == "regression" and out.dim() > 2:
            raise ValueError(
                f"dense regression outputs [N, {', '.join(map(str, out.shape[1:]))}] are not "
                "supported through laplace-torch: it counts only the last axis "
                f"(n_outputs={out.shape[-1]}) in the Gaussian normaliser of log_likelihood and "
                "the marginal likelihood, which makes both (and sigma_noise tuning) wrong. "
                "Flatten the outputs in the model, e.g. Laplace(nn.Sequential(net, "
                "nn.Flatten()), 'regression', ...) with targets y.flatten(1), so that all "
                "C·H·W outputs are counted; lsn_ext.predict works on the flat model too"
            )
        if isinstance(self.loss_fn, CrossEntropy) and out.dim() >= 2 and out.shape[1] == 1:
            raise ValueError(
                f"cross-entropy over one logit channel (output {tuple(out.shape)}) is constant: "
                "for binary segmentation with one channel pass backend_kwargs={'loss': 'bce'}"
            )
        self._checked_output = state

    def diag(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Loss and estimated GGN diagonal on one batch, ``(scalar, [n_params])``.

        Args:
            x: Inputs ``[B, *]``.
            y: Targets as the loss expects.
            **kwargs: ``N`` (the data-set size, passed by laplace-torch; with more than one
                rank it checks that the ranks see each sample once per fit).

        Raises:
            TypeError: For options other than ``N`` (laplace-torch's ``asdl_fisher_kwargs``,
                which this backend does not use).
            ValueError: For a dictionary batch whose model is not a ``SelectInput`` with the key
                ``dict_key_x``, NaN/inf inputs or targets, an empty batch, and outputs laplace-torch
                would mishandle (dense regression, cross-entropy on one channel), and in a
                distributed fit for ranks that disagree on ``N`` or see more than ``N``
                samples together (see :mod:`lsn_ext.distributed`).
        """
        unknown = sorted(set(kwargs) - {"N"})
        if unknown:
            raise TypeError(
                f"DiagBackprop got curvature options {unknown}: these come from "
                "Laplace(..., asdl_fisher_kwargs=...), which only the ASDL backends use; "
                "leave asdl_fisher_kwargs out (DiagBackprop's options go in backend_kwargs)"
            )
        world = self._world()
        try:
            x = check_images(self._tensor_input(x), "the batch's inputs")
            y = plain_tensor(y)
            if not isinstance(y, Tensor):
                raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
            _check_finite("the batch's targets", y)
            self._check_output(x)
            result = ggn_diagonal(
                self.model,
                x,
                y,
                self.loss_fn,
                estimator=self.estimator,
                mc_samples=self.mc_samples,
                shrinkage=self.shrinkage,
                generator=self._batch_generator(x, y) if self.stochastic else None,
                ce_first_step=self.ce_first_step,
                params=self.params,
            )
        except Exception as err:
            if world is None:
                raise
            self._stop_together(err)
            raise
        H, loss = result.vector, result.loss
        if self.subnetwork_indices is not None:
            H = H[self.subnetwork_indices]
        if world is not None:
            self._stop_together(None)
            loss, H = self._reduce(loss, H, x.shape[0], kwargs.get("N"))
        return loss, H

    def _stop_together(self, error: Exception | None) -> None:
        """One collective per batch: every rank learns which ranks could not fit their batch.

        A rank that raised alone would leave the others blocked in the next all-reduce (gloo
        then reports a reset connection, NCCL hangs until its timeout). Here a failing rank
        adds its rank to its own error, and every other rank raises a ``RuntimeError`` naming
        the failing ranks; the fit's sample counter is reset.
        """
        rank, size = _dist.world() or (0, 1)
        device = _dist.collective_device(self.params[0])
        flags = torch.zeros(size, dtype=torch.int64, device=device)
        flags[rank] = int(error is not None)
        failed = [r for r, f in enumerate(_dist.all_reduce_sum(flags).tolist()) if f]
        if not failed:
            return
        self._seen = 0
        if error is not None:
            error.add_note(
                f"(rank {rank} of {size}; every rank of the fit stopped with it: ranks {failed} "
                "failed on this batch)"
            )
            return
        raise RuntimeError(
            f"rank {rank}: rank(s) {failed} could not fit their batch (their own error says "
            "why); this rank stops as well, so that no collective is left waiting"
        )

    def gradients(self, x: Tensor | MutableMapping[str, Any], y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of the loss, ``([B, n_params], summed loss)``.

        One backward pass per sample (``torch.autograd.grad``: the parameters' ``.grad`` are
        left alone), subnetwork indices applied.
        """
        x = check_images(self._tensor_input(x), "x")
        rows, total = [], 0.0
        for i in range(x.shape[0]):
            with torch.enable_grad():
                value = self.loss_fn.value(self.model(x[i : i + 1]), y[i : i + 1])
                grads = torch.autograd.grad(value, self.params, allow_unused=True)
            rows.append(
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).reshape(-1)
                        for g, p in zip(grads, self.params, strict=True)
                    ]
                )
            )
            total = total + value.detach()
        Gs = torch.stack(rows)
        if self.subnetwork_indices is not None:
            Gs = Gs[:, self.subnetwork_indices]
        return Gs, total

    def full(self, *args: Any, **kwargs: Any):
        """Not available: DB computes a diagonal."""
        raise NotImplementedError(
            "DiagBackprop computes the GGN diagonal only; use hessian_structure='diag'"
        )

    def eig_lowrank(self, *args: Any, **kwargs: Any):
        """Not available: laplace-torch's ``hessian_structure="lowrank"`` needs ASDL's Hessian."""
        raise NotImplementedError(
            "DiagBackprop computes the GGN diagonal only; hessian_structure='lowrank' needs "
            "laplace-torch's AsdfghjklHessian backend. Use hessian_structure='diag'"
        )

    def kron(self, *args: Any, **kwargs: Any):
        """Not available: DB computes a diagonal."""
        raise NotImplementedError(
            "DiagBackprop computes the GGN diagonal only; use hessian_structure='diag' "
            "(a Kronecker-factored curvature is not defined for segmentation outputs here)"
        )

    def jacobians(self, x: Tensor | MutableMapping[str, Any], enable_backprop: bool = False):
        """laplace-torch's Jacobians for ``[N, K]`` softmax or Gaussian models; refuses others.

        laplace-torch's GLM predictive treats the last axis as the outputs, which mixes pixels
        and classes for ``[N, C, H, W]`` logits, and always applies a softmax, which is 1 for
        one BCE logit. Use :func:`lsn_ext.predict` for those.

        Raises:
            ValueError: For a BCE loss or outputs that are not ``[N, K]``.
        """
        x = self._tensor_input(x)
        if isinstance(self.loss_fn, BCEWithLogits):
            raise ValueError(
                "laplace-torch's predictive (la(x), its GLM grid search) applies a softmax over "
                "the outputs, which is 1 for every input of a BCE (sigmoid) model. Use "
                "lsn_ext.predict(la, x) for the sigmoid predictive and "
                "lsn_ext.gridsearch_prior_precision(la, val_loader) to tune the prior; "
                "la(x, pred_type='nn') cannot be intercepted and is wrong for BCE models too"
            )
        with torch.no_grad():
            shape = self.model(x[:1]).shape
        if len(shape) != 2:
            raise ValueError(
                f"the model returns logits of shape [N, {', '.join(map(str, shape[1:]))}]; "
                "laplace-torch's predictive (la(x), GLM grid search) assumes [N, K]. Use "
                "lsn_ext.predict(la, x) for per-pixel maps and "
                "lsn_ext.gridsearch_prior_precision(la, val_loader) to tune the prior"
            )
        return super().jacobians(x, enable_backprop)


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


_LINKS = ("softmax", "sigmoid", "identity")
PRED_TYPES = ("glm", "nn")
LINK_APPROXES = ("mc", "probit", "bridge")


def link_of(la: Any) -> str:
    if not isinstance(la, BaseLaplace):
        if getattr(la, "link", None) not in _LINKS:
            raise ValueError(f"the posterior's link must be one of {_LINKS}")
        return la.link
    backend = la.backend
    loss = backend.loss_fn if isinstance(backend, DiagBackprop) else None
    if la.likelihood in ("regression", "reward_modeling"):  # rewards are predicted as regression
        return "identity"
    if isinstance(loss, BCEWithLogits):
        return "sigmoid"
    if loss is None or isinstance(loss, CrossEntropy):
        return "softmax"
    raise ValueError(f"no predictive link for loss {type(loss).__name__}")


def categorical_entropy(p: Tensor, link: str) -> Tensor:
    """Entropy in nats of per-position categorical (softmax) or Bernoulli (sigmoid) ``p``."""
    tiny = torch.finfo(p.dtype).tiny
    if link == "sigmoid":
        q = 1 - p
        return -(p * p.clamp_min(tiny).log() + q * q.clamp_min(tiny).log()).sum(1)
    return -(p * p.clamp_min(tiny).log()).sum(1)


def trainable_params(la: Any) -> list[tuple[str, Tensor]]:
    """The model's parameters with ``requires_grad``, checked against those the posterior covers.

    A laplace-torch posterior covers the parameters that had ``requires_grad=True`` when it was
    created (``la.params``); one frozen or unfrozen since is named.

    Raises:
        ValueError: A parameter whose ``requires_grad`` changed since the posterior was created,
            or (for posteriors that do not list their tensors) another number of trainable
            entries than ``la.n_params``.
    """
    model = _dist.unwrap(la.model)
    everything = list(model.named_parameters())
    named = [(n, p) for n, p in everything if p.requires_grad]
    covered = getattr(la, "params", None)
    if isinstance(covered, list) and all(isinstance(p, Tensor) for p in covered):
        ids = {id(p) for p in covered}
        for n, p in everything:
            if p.requires_grad == (id(p) in ids):
                continue
            if p.requires_grad:
                raise ValueError(
                    f"parameter {n!r} has requires_grad=True now but was frozen when the "
                    "posterior was fitted, so the posterior has no variance for it. Freeze it "
                    f"again for the predictive (model.get_parameter({n!r})."
                    "requires_grad_(False)), or fit a new Laplace with it trainable"
                )
            raise ValueError(
                f"parameter {n!r} has requires_grad=False now but was trainable when the "
                "posterior was fitted, and the posterior covers it. Make it trainable again for "
                f"the predictive (model.get_parameter({n!r}).requires_grad_(True)), or fit a new "
                "Laplace after freezing it"
            )
    total = sum(p.numel() for _, p in named)
    if total != la.n_params:
        raise ValueError(
            f"the model has {total} trainable parameter entries (requires_grad=True) but the "
            f"posterior covers {la.n_params}: a parameter was frozen or unfrozen since the "
            "posterior was created. Restore requires_grad as it was then, or build a new "
            "posterior"
        )
    return named


def check_fitted(la: Any) -> None:
    if not all(hasattr(la, a) for a in ("sample", "model", "n_params")):
        raise TypeError(
            "expected a fitted laplace-torch Laplace object or a posterior with model, "
            f"n_params, sample(n, generator=) and link; got {type(la).__name__}"
        )
    fitted = getattr(la, "H", None) is not None and getattr(la, "n_data", 0) > 0
    if isinstance(la, BaseLaplace) and not fitted:
        raise ValueError("the Laplace object is not fitted yet: call la.fit(train_loader) first")


def check_n_samples(n_samples: Any) -> None:
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 2:
        raise ValueError(
            f"n_samples must be an int of at least 2 to estimate a variance, got {n_samples!r}"
        )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


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


def _probs(f: Tensor, link: str) -> Tensor:
    if link == "softmax":
        return torch.softmax(f, 1)
    if link == "sigmoid":
        return torch.sigmoid(f)
    return f


def _outer(t: Tensor) -> Tensor:
    """Per-position outer product over the class axis: ``[N, C, *]`` → ``[N, C, C, *]``."""
    return t.unsqueeze(2) * t.unsqueeze(1)


class _Moments:
    """Running moments over samples (Welford): of the probabilities, their entropy and the logits.

    ``full`` also keeps the per-position covariance of the logits over the class axis
    ``[N, C, C, *]`` (for the Laplace Bridge with a softmax link).
    """

    def __init__(self, link: str, full: bool):
        self.link, self.full, self.count = link, full, 0
        self.p_mean = self.p_m2 = self.entropy = self.f_mean = self.f_m2 = None

    def add(self, f: Tensor, logits: bool) -> None:
        self.count += 1
        k = self.count
        p = _probs(f, self.link)
        if self.p_mean is None:
            self.p_mean, self.p_m2 = torch.zeros_like(p), torch.zeros_like(p)
            if self.link != "identity":
                self.entropy = torch.zeros_like(p[:, 0])
        delta = p - self.p_mean
        self.p_mean += delta / k
        self.p_m2 += delta * (p - self.p_mean)
        if self.entropy is not None:
            self.entropy += (categorical_entropy(p, self.link) - self.entropy) / k
        if logits:
            if self.f_mean is None:
                self.f_mean = torch.zeros_like(f)
                self.f_m2 = torch.zeros_like(_outer(f) if self.full else f)
            delta = f - self.f_mean
            self.f_mean += delta / k
            after = f - self.f_mean
            self.f_m2 += delta.unsqueeze(2) * after.unsqueeze(1) if self.full else delta * after


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
    from lsn_ext.vi import GaussianMixture

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
    the caller (see :mod:`lsn_ext.glm`).
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
    from lsn_ext.bridge import LaplaceBridge

    if link == "sigmoid":
        # Binary logit f ~ N(m, v) as two zero-sum logits [−f/2, f/2], exact (bridge_predictive)
        mu = torch.cat([-f_mean / 2, f_mean / 2], 1)
        var = torch.cat([f_second / 4, f_second / 4], 1)
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
        x = _dict_input(la.model, x, la.dict_key_x, "predict")
    x = check_images(plain_tensor(x))
    link = link_of(la)
    if link == "identity" and link_approx != "mc":
        raise ValueError(
            f"link_approx={link_approx!r} approximates a softmax or sigmoid; a regression "
            "posterior's maps are the output mean and variance: use link_approx='mc'"
        )
    named = trainable_params(la)
    model = _dist.unwrap(la.model)
    _check_eval_norms(model, "predict")
    full = link_approx == "bridge" and link == "softmax"
    stats = _Moments(link, full)
    if pred_type == "nn":
        for f in _nn_logits(la, model, named, x, n_samples, generator, window):
            stats.add(_check_logits(f, link), logits=True)
        f_mean, f_second = stats.f_mean, stats.f_m2 / (n_samples - 1)
    else:
        f_mean, tangents = glm_logits(la, model, named, x, n_samples, generator, window)
        _check_logits(f_mean, link)
        f_second, products = torch.zeros_like(_outer(f_mean) if full else f_mean), 0
        for t in tangents:
            products += 1
            f_second += _outer(t) if full else t * t
            stats.add(f_mean + t, logits=False)
            if stats.count < n_samples:
                stats.add(f_mean - t, logits=False)
        f_second /= products
    f_var = f_second.diagonal(dim1=1, dim2=2).movedim(-1, 1) if full else f_second
    mean, variance = stats.p_mean, stats.p_m2 / (n_samples - 1)
    expected_entropy = stats.entropy
    if link == "identity":
        if pred_type == "glm":
            mean, variance = f_mean, f_var
        result = SegmentationPrediction(
            mean, variance, None, None, n_samples, f_mean, f_var, pred_type, link_approx
        )
        return _check_maps(result, la)
    if link_approx == "probit":
        kappa = torch.rsqrt(1 + math.pi / 8 * f_var)
        mean = _probs(kappa * f_mean, link)
    elif link_approx == "bridge":
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


def _nll(
    prediction: SegmentationPrediction, y: Tensor, link: str, ignore_index: int | None
) -> tuple[float, int]:
    """Summed negative log predictive probability of the targets and the number counted."""
    if not isinstance(y, Tensor):
        raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
    p = prediction.mean
    tiny = torch.finfo(p.dtype).tiny
    if link == "sigmoid":
        if y.shape != p.shape and y.shape == p[:, 0].shape and p.shape[1] == 1:
            y = y.unsqueeze(1)
        if y.shape != p.shape:
            raise ValueError(
                f"binary targets of shape {tuple(y.shape)} do not match the predictions "
                f"{tuple(p.shape)}; give masks [N, 1, *] or [N, *]"
            )
        _check_finite("the validation targets", y)
        valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
        y = y.to(p.dtype)
        bad = valid & ((y < 0) | (y > 1))
        if bad.any():
            raise ValueError(
                f"binary target {y[bad][0].item()} is outside [0, 1] and not "
                f"ignore_index={ignore_index}; pass ignore_index= for the value that marks "
                "unlabelled pixels"
            )
        y = torch.where(valid, y, 0)
        nll = -(y * p.clamp_min(tiny).log() + (1 - y) * (1 - p).clamp_min(tiny).log())
        return float((nll * valid).sum()), int(valid.sum())
    expected = p.shape[:1] + p.shape[2:]
    if y.dim() == p.dim() > 2 and y.shape[1] == 1 and y.shape[:1] + y.shape[2:] == expected:
        y = y[:, 0]  # MONAI's label maps [N, 1, *spatial]
    if y.shape != expected:
        raise ValueError(
            f"class targets must have shape {tuple(expected)} for predictions "
            f"{tuple(p.shape)}; got {tuple(y.shape)}"
        )
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"class targets must be integer class indices, got dtype {y.dtype}")
    C = p.shape[1]
    valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    bad = valid & ((y < 0) | (y >= C))
    if bad.any():
        raise ValueError(
            f"class target {y[bad][0].item()} is outside [0, {C}) and not "
            f"ignore_index={ignore_index}; pass ignore_index= for the value that marks "
            "unlabelled pixels (e.g. 255)"
        )
    picked = p.gather(1, torch.where(valid, y, 0).long().unsqueeze(1)).squeeze(1)
    return float(-(picked.clamp_min(tiny).log() * valid).sum()), int(valid.sum())


@dataclass
class GridSearchResult:
    """What :func:`gridsearch_prior_precision` found (``la.prior_precision`` is already set).

    Attributes:
        prior_precision: The chosen value.
        grid: The candidates, in the order tried.
        scores: Mean negative log predictive probability per labelled pixel for each candidate
            (``inf`` where it was not finite).
    """

    prior_precision: float
    grid: list[float]
    scores: list[float]


_STRUCTURES = ("scalar", "layerwise", "diag")


def _grid(
    grid: Iterable[float] | None,
    log_prior_prec_min: float,
    log_prior_prec_max: float,
    grid_size: int,
    log_prior_prec_base: float,
) -> list[float]:
    if grid is None:
        if isinstance(grid_size, bool) or not isinstance(grid_size, int) or grid_size < 1:
            raise ValueError(f"grid_size must be a positive int, got {grid_size!r}")
        bounds = (log_prior_prec_min, log_prior_prec_max, log_prior_prec_base)
        if not all(math.isfinite(b) for b in bounds) or log_prior_prec_min > log_prior_prec_max:
            raise ValueError(
                "log_prior_prec_min <= log_prior_prec_max must be finite, got "
                f"{log_prior_prec_min} and {log_prior_prec_max}"
            )
        if log_prior_prec_base <= 0 or log_prior_prec_base == 1:
            raise ValueError(
                f"log_prior_prec_base must be positive and not 1, got {log_prior_prec_base}"
            )
        grid = torch.logspace(
            log_prior_prec_min,
            log_prior_prec_max,
            grid_size,
            base=log_prior_prec_base,
            dtype=torch.float64,
        ).tolist()
    values = [float(v) for v in grid]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"grid must hold finite positive prior precisions, got {values}")
    return values


def gridsearch_prior_precision(
    la: BaseLaplace,
    val_loader: Iterable[Sequence[Tensor]],
    *,
    log_prior_prec_min: float = -4.0,
    log_prior_prec_max: float = 4.0,
    grid_size: int = 21,
    log_prior_prec_base: float = 10.0,
    grid: Iterable[float] | None = None,
    prior_structure: Literal["scalar", "layerwise", "diag"] = "scalar",
    n_samples: int = 10,
    pred_type: Literal["glm", "nn"] = "nn",
    link_approx: Literal["mc", "probit", "bridge"] = "mc",
    ignore_index: int | None = None,
    progress_bar: bool = False,
    verbose: bool = False,
    seed: int = 0,
    distributed: bool | None = None,
) -> GridSearchResult:
    """Choose the prior precision by the per-pixel predictive NLL on validation data.

    The per-pixel counterpart of ``la.optimize_prior_precision(method="gridsearch", ...)``
    (same argument names; laplace-torch's own grid search goes through ``la(x)``, which does not
    support segmentation). Candidates are ``grid``, or ``grid_size`` values log-spaced from
    ``log_prior_prec_base**log_prior_prec_min`` to ``log_prior_prec_base**log_prior_prec_max``.
    For each, sets ``la.prior_precision``, computes :func:`predict` on ``val_loader`` with
    common random numbers (the same seed for every candidate) and scores the mean negative log
    predictive probability per labelled pixel; a candidate whose predictive is not finite (a
    posterior too wide for the dtype) scores ``inf``. Like laplace-torch, it leaves
    ``la.prior_precision`` at the best value (in ``prior_structure``); unlike laplace-torch it
    also returns the scores. On an error the previous prior precision is restored.

    Data-parallel (``torch.distributed`` initialised, more than one rank): each rank scores its
    own shard of the validation data and the NLL sums and pixel counts are all-reduced per
    candidate (one collective each), so every rank chooses the same prior precision.

    Args:
        la: A fitted laplace-torch ``Laplace`` with a classification likelihood.
        val_loader: Batches ``(x, y)``: class indices ``[N, *]`` (integer), or binary masks
            ``[N, 1, *]`` / ``[N, *]`` in ``[0, 1]`` for a BCE backend.
        log_prior_prec_min: Exponent of the smallest candidate.
        log_prior_prec_max: Exponent of the largest candidate.
        grid_size: Number of candidates.
        log_prior_prec_base: Base of the exponents.
        grid: Explicit candidates (positive), instead of the log-spaced ones.
        prior_structure: Shape of the prior precision that is set: ``"scalar"`` (one value),
            ``"layerwise"`` or ``"diag"`` (the chosen value repeated per parameter tensor or
            parameter, e.g. as a start for ``method="marglik"``); every candidate is a single
            value either way.
        n_samples: Posterior samples per prediction (at least 2).
        pred_type: The predictive whose NLL is scored (:func:`predict`): tune the prior for
            the predictive you will use.
        link_approx: Its link approximation (:func:`predict`).
        ignore_index: Target value of unlabelled pixels (e.g. ``255``), not scored. Default:
            the cross-entropy loss's ``ignore_index`` (``-100``) for multi-class models, none
            for binary ones.
        progress_bar: Show a progress bar over the candidates.
        verbose: Print the chosen prior precision.
        seed: Seed of the common random numbers (the same on every rank).
        distributed: Sum the scores over the ranks. Default: as the backend's ``distributed``
            option for :class:`DiagBackprop`, else ``True``; ignored for one process.

    Returns:
        The :class:`GridSearchResult` (chosen value, candidates, scores).

    Raises:
        TypeError: If ``la`` is not a laplace-torch ``Laplace`` or a batch is not ``(x, y)``.
        ValueError: For regression, an unfitted ``la``, bad grid options, an empty loader or
            no labelled pixels, targets that are NaN, of the wrong shape or dtype, or outside
            the classes and not ``ignore_index``.
    """
    if not isinstance(la, BaseLaplace):
        raise TypeError(
            "gridsearch_prior_precision tunes a laplace-torch Laplace object's prior precision; "
            f"got {type(la).__name__}"
        )
    check_fitted(la)
    link = link_of(la)
    if link == "identity":
        raise ValueError(
            "gridsearch_prior_precision needs a classification likelihood; for regression (and "
            "reward_modeling, whose predictive is a regression) use "
            "la.optimize_prior_precision(method='marglik')"
        )
    check_n_samples(n_samples)
    check_choice("pred_type", pred_type, PRED_TYPES)
    check_choice("link_approx", link_approx, LINK_APPROXES)
    if prior_structure not in _STRUCTURES:
        raise ValueError(f"prior_structure must be one of {_STRUCTURES}, got {prior_structure!r}")
    values = _grid(grid, log_prior_prec_min, log_prior_prec_max, grid_size, log_prior_prec_base)
    if ignore_index is None and link == "softmax":
        loss = la.backend.loss_fn if isinstance(la.backend, DiagBackprop) else None
        ignore_index = loss.ignore_index if isinstance(loss, CrossEntropy) else -100

    def structured(value: float) -> Tensor:
        return fix_prior_prec_structure(
            value, prior_structure, la.n_layers, la.n_params, la._device, la._dtype
        )

    if distributed is None:
        distributed = getattr(la.backend, "distributed", True)
    reduce = bool(distributed) and _dist.world() is not None
    previous = la.prior_precision.clone()
    scores: list[float] = []
    try:
        pbar = tqdm.tqdm(values, disable=not progress_bar)
        for value in pbar:
            la.prior_precision = value
            total, count, n_batches = 0.0, 0, 0
            for batch, data in enumerate(val_loader):
                if isinstance(data, Mapping):
                    if la.dict_key_y not in data:
                        raise ValueError(
                            f"the validation batch has no key dict_key_y={la.dict_key_y!r} "
                            f"(keys: {sorted(map(str, data))})"
                        )
                    x = _dict_input(la.model, data, la.dict_key_x, "gridsearch_prior_precision")
                    y = data[la.dict_key_y]
                elif len(data) != 2:
                    raise TypeError(
                        "val_loader must yield (x, y) pairs of tensors (or dictionary batches "
                        f"with dict_key_x and dict_key_y), got a {type(data).__name__}"
                    )
                else:
                    x, y = data
                x, y = check_images(plain_tensor(x)), plain_tensor(y)
                gen = torch.Generator(device=x.device).manual_seed(seed + batch)
                try:
                    pred = predict(
                        la,
                        x,
                        n_samples,
                        pred_type=pred_type,
                        link_approx=link_approx,
                        generator=gen,
                    )
                except NonFinitePredictiveError:
                    total, n_batches = math.inf, n_batches + 1
                    continue
                nll, labelled = _nll(pred, y, link, ignore_index)
                total, count, n_batches = total + nll, count + labelled, n_batches + 1
            if reduce:
                sums = torch.tensor([total, count, n_batches], dtype=torch.float64)
                sums = _dist.all_reduce_sum(sums.to(_dist.collective_device(la.mean)))
                total, n_labelled, n_seen = sums.tolist()
                count, n_batches = round(n_labelled), round(n_seen)
            if n_batches == 0:
                raise ValueError("val_loader yielded no batches")
            if count == 0 and math.isfinite(total):
                raise ValueError(
                    f"val_loader holds no labelled pixels (all targets are ignore_index="
                    f"{ignore_index})"
                )
            scores.append(total / count if math.isfinite(total) else math.inf)
            if progress_bar:
                pbar.set_description(
                    f"[Grid search | prior_prec: {value:.3e}, NLL: {scores[-1]:.3f}]"
                )
        if not any(math.isfinite(s) for s in scores):
            raise ValueError(f"every prior precision in {values} gave a non-finite validation NLL")
    except BaseException:
        la.prior_precision = previous
        raise
    best = values[min(range(len(values)), key=scores.__getitem__)]
    la.prior_precision = structured(best)
    if verbose:
        print(f"Optimized prior precision is {best}.")
    return GridSearchResult(best, values, scores)
