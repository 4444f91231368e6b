"""The laplace-torch backend :class:`DiagBackprop` and the link of a fitted posterior.

:class:`DiagBackprop` is what laplace-torch calls (``diag``, ``gradients``, ``jacobians``); it
gets each batch's GGN diagonal from :func:`lsn_ext.ggn_diagonal`, seeds the Monte-Carlo vectors
per batch (:mod:`lsn_ext.laplace_ext.digest`) and all-reduces over the ranks of a data-parallel
fit. :func:`link_of` reads the predictive link from a posterior (:mod:`lsn_ext.links`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lsn_ext import distributed as _dist
from lsn_ext._fingerprint import fingerprint
from lsn_ext._laplace import (
    BaseLaplace,
    CurvatureInterface,
    GGNInterface,
)
from lsn_ext._laplace import (
    baselaplace as _laplace_module,
)
from lsn_ext.estimators import Estimator, check_estimator, ggn_diagonal
from lsn_ext.kron import check_kron_options, kron_curvature
from lsn_ext.laplace_ext.checks import (
    check_eval_norms,
    check_finite,
    check_images,
    check_trainable,
    dict_input,
)
from lsn_ext.laplace_ext.digest import batch_digest, tensor_bytes
from lsn_ext.laplace_ext.head import HeadFeatureExtractor
from lsn_ext.laplace_ext.head_curvature import head_curvature
from lsn_ext.links import check_link, link_of_likelihood
from lsn_ext.lowrank import LowRankGGN, lowrank_ggn
from lsn_ext.outputs import plain_tensor
from lsn_ext.rules.losses import MSE, BCEWithLogits, CrossEntropy, Loss, as_loss

__all__ = ["DiagBackprop", "link_of"]

# The fit methods of laplace-torch's Laplace classes (see DiagBackprop._track_fit).
_FIT_CODES = frozenset(
    cls.fit.__code__
    for cls in vars(_laplace_module).values()
    if isinstance(cls, type) and issubclass(cls, BaseLaplace) and "fit" in vars(cls)
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

    Reproducibility: by default (``seed=0``) the Monte-Carlo vectors of a batch are a deterministic
    function of ``(seed, the batch's inputs and targets)``: a hash of their bytes (on the CPU) or of
    a fingerprint of them computed on their device (on an accelerator: no copy of the batch to the
    host, four integers come back) seeds a fresh generator per batch on the batch's device. CPU and
    CUDA generators differ, so the vectors (not their distribution) depend on the device too. A
    refit on the same data gives the same ``H`` (on CUDA up to the rounding of its non-deterministic
    sums, unless ``torch.use_deterministic_algorithms(True)``), three online fits ``fit(loader,
    override=False)`` give three times the ``H`` of one, and the result does not depend on torch's
    global random state; different batches (and different seeds) still get different vectors.
    ``seed=None`` draws from torch's global generator instead (a refit then differs).

    Data-parallel fits (``torchrun``, see :mod:`lsn_ext.distributed`): when ``torch.distributed``
    is initialised with more than one rank, ``diag`` all-reduces (sums) each batch's curvature
    and loss, so every rank ends with the ``H``, ``loss`` and ``n_data`` of a single-process fit
    over all shards. Every rank must then make the same number of ``diag`` calls, and the ranks
    must see each sample once per fit (no padded ``DistributedSampler``; per-rank datasets via
    :class:`lsn_ext.distributed.ShardedLoader`). The rank is folded into the Monte-Carlo seed, so
    ranks never share vectors, even for identical batches. A DDP-wrapped model is unwrapped (the
    curvature runs on ``model.module``).

    **What laplace-torch's ``fit`` does to the model** (its own code, before this backend
    exists, so it cannot undo it): ``la.fit`` leaves the model in eval mode (``model.eval()``,
    batch norm included), with ``.grad`` ``None`` (``model.zero_grad()`` before every batch) and
    ``model.output_size`` set: save ``model.training`` (or each module's) before the call and
    restore it after. ``la(x, pred_type="nn")`` leaves the parameters' data as views into
    ``la.mean`` (``vector_to_parameters``), so training the model afterwards changes the posterior
    mean; detach them with ``torch.nn.utils.vector_to_parameters(la.mean.clone(), la.params)``.
    lsn_ext's own entry points (:func:`predict`, :func:`gridsearch_prior_precision`,
    :func:`lsn_ext.lsn.fit_lsn`, ...) leave the model as they found it. The docs' laplace-torch
    guide shows the save-and-restore code.

    Errors laplace-torch raises before the backend exists (not this backend's messages), for a
    frozen or parameterless model, a loader without batches, a channels_last model,
    ``subset_of_weights="last_layer"`` without a final ``nn.Linear`` (use :func:`lsn_ext.Laplace`)
    and ``hessian_structure="lowrank"`` (use :class:`lsn_ext.lowrank.LowRankGGNLaplace`), are listed
    with their remedies in the docs' laplace-torch guide.

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
        last_layer: Set by laplace-torch's last-layer classes: ``full``, ``kron`` and ``diag``
            then return the head's exact GGN (or its KFAC) in closed form
            (:meth:`last_layer_curvature`), for ``nn.Linear`` heads and, through
            :mod:`lsn_ext.laplace_ext.last_layer`, convolution heads.
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
            ``"mc"`` (default: unbiased Monte Carlo, about 2× a training step; its noise averages
            out over the batches of a fit), ``"db"`` (diagonal backprop, the LSN paper's method:
            deterministic, one backward pass, but 10–10⁶× too small below the last layers of trained
            networks, which breaks marginal-likelihood prior tuning) or ``"db_calibrated"`` (DB
            rescaled per parameter tensor to Monte-Carlo traces, per batch).
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
        kron_mode: ``"expand"`` (default) or ``"reduce"``, the KFAC variant of ``"kron"``
            (Eschenhagen et al., 2023; the pixels share the weights), both measured against the
            exact GGN blocks in ``integration/results/kron_expand_reduce.md``.
        kron_position_fraction: KFAC-expand's patch factor (``A``) from this random fraction of
            the positions, unbiased; default 1 (all): ``kron_curvature``'s ``position_fraction``.

    Raises:
        ValueError: For a model without parameters or with all of them frozen (message says
            which), a loss that does not match the likelihood, a loss with ``reduction="mean"``,
            an unknown estimator, bad estimator options or contradictory
            ``stochastic``/``num_samples``/``estimator``/``mc_samples``.
        TypeError: For a ``seed`` that is not an int or ``None``, or a non-bool ``distributed``.

    For the misuses laplace-torch's own backends also meet (an unknown likelihood, unknown
    options, dictionary batches without ``dict_key_x``/``dict_key_y``, non-tensor inputs, targets
    of the wrong shape, dtype or range) the errors have the types those backends raise
    (``tests/laplace_ext/test_laplace_error_types.py``): target errors are lsn_ext's
    ``ValueError`` and also torch's ``RuntimeError`` (shape, dtype) or ``IndexError`` (class out
    of range), see :class:`~lsn_ext.rules.losses.TargetShapeError`.
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
        kron_mode: Literal["expand", "reduce"] = "expand",
        kron_position_fraction: float = 1.0,
    ):
        # GGNInterface.__init__ would store ``stochastic``/``num_samples``; here they are
        # read-only views of the estimator, so initialise the base interface directly.
        model = _dist.unwrap(model)
        check_trainable(model)
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
        check_kron_options(kron_mode, kron_position_fraction, prefix="kron_")
        self.kron_mode, self.kron_position_fraction = kron_mode, kron_position_fraction
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
            x = dict_input(self.model, x, self.dict_key_x, "DiagBackprop")
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
                digest.update(tensor_bytes(t))
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
                ``dict_key_x``, NaN/inf inputs or targets, an empty batch, outputs laplace-torch
                would mishandle (dense regression, cross-entropy on one channel), and in a
                distributed fit for ranks that disagree on ``N`` or see more than ``N`` samples
                together (:mod:`lsn_ext.distributed`).

        Returns:
            ``(loss, H)``: the summed loss and the GGN diagonal's estimate ``[n_params]``.
        """
        _refuse_options(set(kwargs) - {"N"})
        if self.last_layer:
            return self.last_layer_curvature(x, y, structure="diag", **kwargs)
        world = self._world()
        try:
            x, y = self._checked_batch(x, y)
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

    def _checked_batch(self, x: Tensor | MutableMapping[str, Any], y: Any) -> tuple[Tensor, Tensor]:
        """A batch's inputs and targets as tensors, checked finite, and the model's output."""
        x = check_images(self._tensor_input(x), "the batch's inputs")
        y = plain_tensor(y)
        if not isinstance(y, Tensor):
            raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
        check_finite("the batch's targets", y)
        self._check_output(x)
        return x, y

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

        Args:
            x: Inputs ``[B, *]`` or a dictionary batch.
            y: Targets as the loss expects.

        Returns:
            ``(Gs [B, n_params], loss)``.

        Raises:
            ValueError: For NaN/inf inputs.
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
        """The head's exact GGN for last-layer Laplace; not available over all weights.

        Args:
            *args: ``(x, y)`` as for :meth:`last_layer_curvature`.
            **kwargs: ``N`` as for :meth:`last_layer_curvature`.

        Returns:
            (tuple[Tensor, Tensor]): ``(loss, H)``, ``H`` the head's dense GGN.

        Raises:
            NotImplementedError: Over all weights (no ``P × P`` GGN is formed).
        """
        if self.last_layer:
            return self.last_layer_curvature(*args, structure="full", **kwargs)
        raise NotImplementedError(
            "DiagBackprop does not form the full P×P GGN over all weights: use "
            "hessian_structure='diag' or 'kron', a low-rank posterior "
            "(lsn_ext.lowrank.LowRankGGNLaplace), or subset_of_weights='last_layer'"
        )

    # -- last-layer Laplace (lsn_ext.laplace_ext.head_curvature) ------------------------------
    def last_layer_curvature(
        self,
        x: Tensor | MutableMapping[str, Any],
        y: Tensor,
        structure: Literal["full", "diag", "kron"],
        N: int | None = None,
    ) -> tuple[Tensor, Any]:
        """``(loss, H)`` of the head (``last_layer=True``): its exact GGN, or its KFAC.

        laplace-torch's last-layer classes wrap the model in a ``FeatureExtractor``; the head
        is its ``last_layer`` (an ``nn.Linear`` for laplace-torch's own classes; a convolution
        too for :mod:`lsn_ext.laplace_ext.last_layer`). The curvature is computed in closed
        form from the head's per-position features and the loss Hessian
        (:func:`~lsn_ext.laplace_ext.head_curvature.head_curvature`: no Monte Carlo, so the
        estimator options do not apply).

        Args:
            x: Inputs ``[B, *]`` or a dictionary batch.
            y: Targets as the loss expects.
            structure: ``"full"`` (``H [P, P]``), ``"diag"`` (``[P]``) or ``"kron"`` (``Kron``).
            N: The data-set size (``"kron"`` only; default: the batch size).

        Returns:
            ``(loss, H)`` for the head's ``P`` parameters.

        Raises:
            ValueError: In a data-parallel fit (not supported for the last layer), for NaN/inf
                inputs or targets, and for outputs laplace-torch's own last-layer classes would
                mishandle (dense regression, cross-entropy on one channel).
        """
        if self._world() is not None:
            raise ValueError(
                "last-layer Laplace through DiagBackprop runs in one process: fit it on one "
                "rank, or pass backend_kwargs={'distributed': False} for per-rank posteriors"
            )
        extractor = self.model
        if not isinstance(x, Mapping):
            x = check_images(plain_tensor(x), "the batch's inputs")
            if not isinstance(extractor, HeadFeatureExtractor):
                self._check_output(x)  # laplace-torch's own classes: n_outputs = out.shape[-1]
        y = plain_tensor(y)
        if not isinstance(y, Tensor):
            raise TypeError(f"targets must be a tensor, got {type(y).__name__}")
        check_finite("the batch's targets", y)
        name = getattr(extractor, "_last_layer_name", "head")
        return head_curvature(
            extractor.model, extractor.last_layer, x, y, self.loss_fn, structure, N, name
        )

    def eig_lowrank(self, data_loader: Any, rank: int = 10, **options: Any) -> LowRankGGN:
        """Top GGN eigenpairs over the whole loader (:func:`lsn_ext.lowrank.lowrank_ggn`).

        Lanczos on matrix-free GGN-vector products of this backend's loss; the start vector is
        seeded by ``seed`` (``None``: torch's global generator). Host it with
        :class:`lsn_ext.lowrank.LowRankGGNLaplace` (laplace-torch's ``Laplace(...,
        hessian_structure="lowrank")`` refuses to start without the ``asdfghjkl`` package).

        Args:
            data_loader: ``(x, y)`` or dictionary batches, iterated once per product.
            rank: Eigenpairs kept (default 10).
            **options: ``energy``, ``steps``, ``trace_probes``, ``tol`` of ``lowrank_ggn``.

        Returns:
            :class:`~lsn_ext.lowrank.LowRankGGN`, which unpacks as laplace-torch's
            ``(eigenvectors [P, k], eigenvalues [k], loss)``.

        Raises:
            ValueError: In a data-parallel fit or a subnetwork Laplace (not supported), for a
                model in training mode, or what ``lowrank_ggn`` refuses.
        """
        if self._world() is not None or self.subnetwork_indices is not None:
            raise ValueError(
                "eig_lowrank covers all weights of a single-process fit: leave out "
                "subnetwork_indices and use backend_kwargs={'distributed': False} (or one rank)"
            )
        check_eval_norms(self.model, "eig_lowrank")
        device = self.params[0].device

        def split(batch: Any) -> tuple[Tensor, Tensor]:
            x, y = (batch, batch[self.dict_key_y]) if isinstance(batch, Mapping) else batch
            x = check_images(self._tensor_input(x).to(device), "the batch's inputs")
            y = plain_tensor(y).to(device)
            check_finite("the batch's targets", y)
            return x, y

        self._check_output(split(next(iter(data_loader)))[0])
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
        return lowrank_ggn(
            self.model, data_loader, self.loss_fn, rank=rank, generator=generator, split=split,
            **options,
        )  # fmt: skip

    def kron(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, N: int | None = None, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        """Loss and KFAC GGN of one batch in laplace-torch's ``Kron`` format.

        Over all weights: :func:`lsn_ext.kron.kron_curvature` (KFAC-``kron_mode`` factors for
        every ``Linear``, ``Conv1–3d`` and ``ConvTranspose1–3d`` weight, a block for every other
        parameter; ``G`` from ``mc_samples`` draws of the loss Hessian's square root, exact for
        one BCE channel). For 3-D convolution weights host it with
        :class:`lsn_ext.kron.KronLaplaceND` (laplace-torch's ``KronLaplace`` refuses 5-D
        weights before the backend runs). With ``last_layer=True``: the head's KFAC.

        Args:
            x: Inputs ``[B, *]`` or a dictionary batch.
            y: Targets as the loss expects.
            N: The data-set size (laplace-torch passes it).
            **kwargs: Refused (laplace-torch's ``asdl_fisher_kwargs``).

        Returns:
            ``(loss, kron)``, the summed loss and laplace-torch's ``Kron``.

        Raises:
            TypeError: For options other than ``N``.
            ValueError: In a data-parallel fit or a subnetwork Laplace (not supported for
                Kron), for NaN/inf inputs or targets, and what ``kron_curvature`` refuses.
        """
        _refuse_options(kwargs)
        if self.last_layer:
            return self.last_layer_curvature(x, y, structure="kron", N=N)
        if self._world() is not None or self.subnetwork_indices is not None:
            raise ValueError(
                "hessian_structure='kron' through DiagBackprop covers all weights of a "
                "single-process fit: leave out subnetwork_indices and use "
                "backend_kwargs={'distributed': False} (or one rank)"
            )
        x, y = self._checked_batch(x, y)
        result = kron_curvature(
            self.model, x, y, self.loss_fn, N=N, mode=self.kron_mode,
            position_fraction=self.kron_position_fraction,
            mc_samples=self.mc_samples if self.stochastic else 1,
            generator=self._batch_generator(x, y),
        )  # fmt: skip
        return result.loss, result.kron

    def jacobians(self, x: Tensor | MutableMapping[str, Any], enable_backprop: bool = False):
        """laplace-torch's Jacobians for ``[N, K]`` softmax or Gaussian models; refuses others.

        laplace-torch's GLM predictive treats the last axis as the outputs, which mixes pixels
        and classes for ``[N, C, H, W]`` logits, and always applies a softmax, which is 1 for
        one BCE logit. Use :func:`lsn_ext.predict` for those.

        Args:
            x: Inputs ``[B, *]``, or a dictionary batch.
            enable_backprop: Keep the graph (as laplace-torch).

        Returns:
            (tuple[Tensor, Tensor]): laplace-torch's ``(Js [B, K, P], f [B, K])``.

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


def _refuse_options(options: Any) -> None:
    """Refuse curvature options (laplace-torch passes ``asdl_fisher_kwargs`` to the backend)."""
    if options:
        raise TypeError(
            f"DiagBackprop got curvature options {sorted(options)}: these come from "
            "Laplace(..., asdl_fisher_kwargs=...), which only the ASDL backends use; "
            "leave asdl_fisher_kwargs out (DiagBackprop's options go in backend_kwargs)"
        )


def link_of(la: Any) -> str:
    """The predictive link of a posterior (:mod:`lsn_ext.links`).

    A laplace-torch ``Laplace``: from its likelihood and, for :class:`DiagBackprop`, its loss
    (``"identity"`` for regression and reward modelling, the loss's link for classification,
    ``"softmax"`` for laplace-torch's own backends). Any other posterior: its ``link``.

    Args:
        la: A laplace-torch ``Laplace``, or any posterior with a ``link`` attribute.

    Returns:
        ``"softmax"``, ``"sigmoid"`` or ``"identity"``.

    Raises:
        ValueError: For a posterior whose ``link`` is not one of :data:`lsn_ext.links.LINKS`,
            or a classification loss without a link (:class:`~lsn_ext.links.NoLinkError`).
    """
    if not isinstance(la, BaseLaplace):
        return check_link(getattr(la, "link", None))
    backend = la.backend
    loss = backend.loss_fn if isinstance(backend, DiagBackprop) else None
    return link_of_likelihood(la.likelihood, loss)
