"""Losses and their Hessians w.r.t. the logits: what starts diagonal backpropagation.

Conventions follow laplace-torch: losses are summed over the batch (``reduction="sum"``), and the
regression loss is ``½ Σ (f − y)²`` so that its Hessian is the identity. ``reduction="mean"``
divides value and Hessian by the same count that ``torch.nn.functional`` divides by.

==============================  ============================  ==================================
loss                            logits / targets              Hessian w.r.t. the logits
==============================  ============================  ==================================
:class:`BCEWithLogits`          ``[N, *]`` / same shape, or    ``p(1−p)(1 + (w₊−1) y) · w``,
                                ``[N, *]`` for ``[N, 1, *]``   diagonal (exact)
:class:`CrossEntropy`           ``[N, C, *]`` / ``[N, *]``     per position ``w_y (diag p − p pᵀ)``,
                                class indices                  a ``C×C`` block
:class:`MSE`                    ``[N, *]`` / same shape        ``1`` (``2`` for ``nn.MSELoss``)
==============================  ============================  ==================================
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MSE",
    "BCEWithLogits",
    "CrossEntropy",
    "Loss",
    "TargetDtypeError",
    "TargetRangeError",
    "TargetShapeError",
    "as_loss",
]

Reduction = Literal["sum", "mean"]


class TargetShapeError(ValueError, RuntimeError):
    """Targets whose shape does not fit the logits.

    A ``ValueError``, like lsn_ext's other bad-input errors, and a ``RuntimeError``: laplace-torch's
    own backends (CurvlinopsGGN, BackPackGGN) let torch's loss raise ``RuntimeError`` for the same
    mistake, so code that catches either keeps working when DiagBackprop replaces them.
    """


class TargetDtypeError(ValueError, RuntimeError):
    """Class targets that are not integers (``RuntimeError`` from torch's cross-entropy)."""


class TargetRangeError(ValueError, IndexError):
    """Class indices outside ``[0, C)`` (``IndexError`` from torch's cross-entropy)."""


def _check_reduction(reduction: str) -> None:
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


class Loss:
    """A loss ``ℓ(f, y)`` on logits ``f`` with a positive semi-definite Hessian w.r.t. ``f``.

    ``link`` names the predictive link of the likelihood (:mod:`lsn_ext.links`): ``"sigmoid"``,
    ``"softmax"`` or ``"identity"``; ``None`` for a loss without one.
    """

    reduction: Reduction = "sum"
    link: ClassVar[str | None] = None

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The loss ``ℓ(f, y)`` of a batch, summed (or averaged, ``reduction="mean"``).

        The negative log-likelihood of the targets up to a constant; what laplace-torch's
        ``BaseLaplace`` and the marginal likelihood read as the data fit.

        Args:
            logits: The network's outputs ``f``, ``[N, *]`` (``[N, C, *]`` for
                :class:`CrossEntropy`).
            targets: As :meth:`check` accepts them.

        Returns:
            The scalar loss, differentiable in ``logits``.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        raise NotImplementedError

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The diagonal of the Hessian w.r.t. the logits, ``diag(∂²ℓ/∂f²)``.

        Exact for :class:`BCEWithLogits`, :class:`CrossEntropy` and :class:`MSE` (a subclass may
        return a positive semi-definite surrogate and say so); it starts diagonal backpropagation
        when the Hessian is diagonal (BCE, MSE), and is the diagonal of :meth:`hessian_block`
        otherwise.

        Args:
            logits: ``[N, *]``.
            targets: As :meth:`check` accepts them.

        Returns:
            Non-negative, shaped like ``logits``.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        raise NotImplementedError

    def hessian_block(self, logits: Tensor, targets: Tensor) -> Tensor | None:
        """The per-position ``[N, C, C, *]`` Hessian block, or ``None`` when it is diagonal.

        Args:
            logits: ``[N, C, *]``.
            targets: As :meth:`check` accepts them.

        Returns:
            ``[N, C, C, *]`` positive semi-definite blocks, or ``None`` (this default) for a
            loss whose Hessian is diagonal (:meth:`hessian_diag` is then all of it).
        """
        return None

    def hessian_sqrt(self, logits: Tensor, targets: Tensor, z: Tensor) -> Tensor:
        """Apply a square root ``B`` of the Hessian (``B Bᵀ = H``) to vectors ``z``.

        With ``E[z zᵀ] = I`` the vectors ``s = B z`` satisfy ``E[s sᵀ] = H``: they start the
        Monte-Carlo GGN estimate (:func:`lsn_ext.ggn_diagonal` with ``estimator="mc"``).
        This default serves losses with a diagonal Hessian: ``s = √h ⊙ z``.

        Args:
            logits: ``[N, *]``.
            targets: As :meth:`check` accepts them.
            z: ``[S, *logits.shape]``, ``S`` vectors.

        Returns:
            ``[S, *logits.shape]``.

        Raises:
            NotImplementedError: For a loss with a non-diagonal Hessian that does not override
                this method.
        """
        if self.hessian_block(logits, targets) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} has a non-diagonal Hessian: implement hessian_sqrt"
            )
        return self.hessian_diag(logits, targets).sqrt() * z

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Validate shapes and values; return the targets in the form the loss uses.

        Args:
            logits: ``[N, *]``.
            targets: The targets as given by the user.

        Returns:
            The targets in the form the loss computes with (shape and dtype).

        Raises:
            TargetShapeError: Targets whose shape does not fit the logits.
            TargetDtypeError: Class targets that are not integers.
            TargetRangeError: Class indices outside ``[0, C)``.
            ValueError: Target values outside the loss's domain, or an empty batch.
            TypeError: Targets that are not a tensor.
        """
        raise NotImplementedError


class BCEWithLogits(Loss):
    """Binary cross-entropy on logits, one independent Bernoulli per entry.

    ``ℓ = −Σ w [w₊ y log σ(f) + (1 − y) log(1 − σ(f))]`` with ``w₊ = pos_weight`` (broadcast as in
    ``torch.nn.BCEWithLogitsLoss``: along the *last* dim of the targets, so give a ``[C, 1, 1]``
    tensor for per-channel weights of ``[N, C, H, W]`` logits) and element weights ``w``.
    Hessian ``∂²ℓ/∂f² = w σ(f)(1 − σ(f))(w₊ y + 1 − y)``: diagonal, so DB starts exactly.

    Args:
        pos_weight: Weight of positive targets (class re-weighting, as in the LSN paper).
        weight: Element weights, broadcast against the logits.
        reduction: ``"sum"`` (laplace-torch's convention) or ``"mean"`` over all entries.
    """

    link: ClassVar[str | None] = "sigmoid"

    def __init__(
        self,
        pos_weight: Tensor | float | None = None,
        weight: Tensor | None = None,
        reduction: Reduction = "sum",
    ):
        _check_reduction(reduction)
        if pos_weight is not None:
            pos_weight = torch.as_tensor(pos_weight)
            if not bool((pos_weight > 0).all()) or not bool(torch.isfinite(pos_weight).all()):
                raise ValueError(f"pos_weight must be positive and finite, got {pos_weight}")
        if weight is not None and (
            not bool((weight >= 0).all()) or not bool(torch.isfinite(weight).all())
        ):
            raise ValueError("weight must be non-negative and finite (no NaN or inf)")
        self.pos_weight, self.weight, self.reduction = pos_weight, weight, reduction

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Validate BCE targets: shaped like the logits, values in ``[0, 1]``.

        Args:
            logits: ``[N, *]``.
            targets: Targets shaped like ``logits`` (``[N, *]`` is accepted for ``[N, 1, *]``
                logits).

        Returns:
            The targets in the logits' dtype and shape.

        Raises:
            TargetShapeError: For a shape that does not fit the logits.
            ValueError: For values outside ``[0, 1]`` (NaN included) or an empty batch.
            TypeError: For targets that are not a tensor.
        """
        if targets.shape != logits.shape:
            if logits.dim() >= 2 and logits.shape[1] == 1 and targets.shape == logits[:, 0].shape:
                targets = targets.unsqueeze(1)
            else:
                raise TargetShapeError(
                    f"BCE targets of shape {tuple(targets.shape)} do not match logits of shape "
                    f"{tuple(logits.shape)}; give targets shaped like the logits (or [N, *] for "
                    "[N, 1, *] logits)"
                )
        check_batch(logits, targets, "BCE")
        targets = targets.to(logits.dtype)
        outside = ~((targets >= 0) & (targets <= 1))  # NaN compares False: caught here
        if bool(outside.any()):
            bad = targets[outside][0].item()
            raise ValueError(
                f"BCE targets must lie in [0, 1]; found {bad} at {int(outside.sum())} entries"
            )
        return targets

    def _scale(self, logits: Tensor) -> float:
        return 1.0 / logits.numel() if self.reduction == "mean" else 1.0

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``ℓ = −Σ w [w₊ y log σ(f) + (1 − y) log(1 − σ(f))]``, as torch's BCE with logits.

        Args:
            logits: ``[N, *]``.
            targets: Probabilities in ``[0, 1]`` shaped like ``logits`` (``[N, *]`` for
                ``[N, 1, *]`` logits).

        Returns:
            The scalar loss (divided by the number of entries for ``reduction="mean"``).

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        pw = None if self.pos_weight is None else self.pos_weight.to(logits)
        w = None if self.weight is None else self.weight.to(logits)
        return F.binary_cross_entropy_with_logits(
            logits, targets, weight=w, pos_weight=pw, reduction=self.reduction
        )

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The Hessian ``w σ(f)(1 − σ(f))(w₊ y + 1 − y)``: diagonal, so this is all of it (exact).

        Args:
            logits: ``[N, *]``.
            targets: Probabilities in ``[0, 1]`` shaped like ``logits`` (``[N, *]`` for
                ``[N, 1, *]`` logits).

        Returns:
            Non-negative, shaped like ``logits``.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        p = torch.sigmoid(logits)
        h = p * (1 - p)
        if self.pos_weight is not None:
            h = h * (self.pos_weight.to(logits) * targets + 1 - targets)
        if self.weight is not None:
            h = h * self.weight.to(logits)
        return (h * self._scale(logits)).expand_as(logits)


class CrossEntropy(Loss):
    """Softmax cross-entropy, classes on dim 1: logits ``[N, C, *]``, class indices ``[N, *]``.

    Label maps ``[N, 1, *]`` (MONAI's layout) are taken as ``[N, *]``.

    ``ℓ = Σ_positions w_y (−log softmax(f)_y)``; positions whose target is ``ignore_index`` add
    nothing. Per position the Hessian is the block ``w_y (diag p − p pᵀ)``, ``p = softmax(f)``;
    its diagonal is ``w_y p(1 − p)``. Label smoothing ``ε`` leaves the Hessian unchanged when
    there are no class weights (every ``−log p_c`` has Hessian ``diag p − p pᵀ``).

    Args:
        weight: Class weights ``[C]``.
        ignore_index: Target value that marks positions to ignore.
        label_smoothing: As in ``torch.nn.CrossEntropyLoss`` (not with ``weight``).
        reduction: ``"sum"`` (laplace-torch) or ``"mean"`` (divided by ``Σ w_y`` over counted
            positions, as torch does).
    """

    link: ClassVar[str | None] = "softmax"

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: Reduction = "sum",
    ):
        _check_reduction(reduction)
        if weight is not None and (
            weight.dim() != 1
            or not bool((weight >= 0).all())
            or not bool(torch.isfinite(weight).all())
        ):
            raise ValueError("weight must be a 1-D tensor of non-negative, finite class weights")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
        if label_smoothing > 0 and weight is not None:
            raise ValueError("label_smoothing together with class weights is not supported")
        self.weight, self.ignore_index = weight, ignore_index
        self.label_smoothing, self.reduction = label_smoothing, reduction

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Validate class targets: integer indices in ``[0, C)`` (or ``ignore_index``).

        Args:
            logits: ``[N, C, *]``, classes on dim 1.
            targets: Class indices ``[N, *]``, or MONAI's label maps ``[N, 1, *]``.

        Returns:
            The targets as ``long`` class indices, ``[N, *]``.

        Raises:
            TargetShapeError: For a shape other than ``[N, *]`` or ``[N, 1, *]``.
            TargetDtypeError: For floating-point (or complex) targets.
            TargetRangeError: For an index outside ``[0, C)`` that is not ``ignore_index``.
            ValueError: For logits without a class axis, class weights of the wrong length,
                or an empty batch.
            TypeError: For targets that are not a tensor.
        """
        if logits.dim() < 2:
            raise ValueError(
                f"cross-entropy needs logits [N, C, *] with classes on dim 1; got shape "
                f"{tuple(logits.shape)}"
            )
        expected = logits.shape[:1] + logits.shape[2:]
        monai_layout = targets.dim() == logits.dim() > 2 and targets.shape[1] == 1
        if monai_layout and targets.shape[:1] + targets.shape[2:] == expected:
            targets = targets[:, 0]  # MONAI's label maps [N, 1, *spatial]
        if targets.shape != expected:
            # [N, 1, *spatial] label maps are accepted for spatial logits only (see above)
            layouts = f"{tuple(expected)}" + (
                f" (or {(expected[0], 1, *expected[1:])})" if logits.dim() > 2 else ""
            )
            raise TargetShapeError(
                f"cross-entropy targets must be class indices of shape {layouts} for logits "
                f"{tuple(logits.shape)}; got {tuple(targets.shape)}"
            )
        if targets.is_floating_point() or targets.is_complex():
            raise TargetDtypeError(
                f"cross-entropy targets must be integer class indices, got dtype {targets.dtype} "
                "(label maps loaded as floats, e.g. by MONAI's LoadImage: cast them with .long(), "
                "or add monai.transforms.CastToTyped(keys='label', dtype=torch.long))"
            )
        check_batch(logits, targets, "cross-entropy")
        C = logits.shape[1]
        if self.weight is not None and self.weight.numel() != C:
            raise ValueError(f"weight has {self.weight.numel()} entries but the logits {C} classes")
        valid = targets != self.ignore_index
        bad = valid & ((targets < 0) | (targets >= C))
        if bad.any():
            raise TargetRangeError(
                f"cross-entropy target {targets[bad][0].item()} is outside [0, {C}) and not "
                f"ignore_index={self.ignore_index}"
            )
        return targets.long()

    def _position_weight(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``w_y`` per position (0 where ignored), divided by the mean's count; ``[N, *]``."""
        valid = targets != self.ignore_index
        safe = torch.where(valid, targets, 0)
        w = valid.to(logits.dtype)
        if self.weight is not None:
            w = w * self.weight.to(logits)[safe]
        if self.reduction == "mean":
            w = w / w.sum().clamp_min(torch.finfo(logits.dtype).tiny)
        return w

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``ℓ = Σ_positions w_y (−log softmax(f)_y)``, as ``F.cross_entropy``.

        Args:
            logits: ``[N, C, *]``, classes on dim 1.
            targets: Class indices ``[N, *]`` (or MONAI's ``[N, 1, *]``), integer dtype.

        Returns:
            The scalar loss (divided by ``Σ w_y`` over counted positions for
            ``reduction="mean"``).

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        w = None if self.weight is None else self.weight.to(logits)
        return F.cross_entropy(
            logits,
            targets,
            weight=w,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
        )

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The exact diagonal of the softmax block, ``w_y p_c Σ_{l≠c} p_l = w_y p_c (1 − p_c)``.

        Args:
            logits: ``[N, C, *]``, classes on dim 1.
            targets: Class indices ``[N, *]`` (or MONAI's ``[N, 1, *]``), integer dtype.

        Returns:
            Non-negative, ``[N, C, *]``; the off-diagonal ``−w_y p_c p_l`` are in
            :meth:`hessian_block`.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        p = torch.softmax(logits, 1)
        return p * _others(p) * self._position_weight(logits, targets).unsqueeze(1)

    def hessian_block(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``w_y (diag p − p pᵀ)`` per position, ``[N, C, C, *]``.

        The diagonal is ``p_c Σ_{l≠c} p_l`` rather than ``p_c (1 − p_c)``: when ``p_c`` rounds
        to 1 the latter is 0 while the off-diagonal entries ``−p_c p_l`` are not, and the block
        is indefinite (negative DB diagonals). As computed, the block is diagonally dominant
        with non-positive off-diagonal entries (to a few ulp), hence positive semi-definite.

        Args:
            logits: ``[N, C, *]``, classes on dim 1.
            targets: Class indices ``[N, *]`` (or MONAI's ``[N, 1, *]``), integer dtype.

        Returns:
            ``[N, C, C, *]``, zero at ignored positions.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        p = torch.softmax(logits, 1)
        w = self._position_weight(logits, targets)
        eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
        eye = eye.reshape(1, *eye.shape, *([1] * (p.dim() - 2)))
        diag = (p * _others(p)).unsqueeze(2) * eye
        block = diag - (p.unsqueeze(2) * p.unsqueeze(1)) * (1 - eye)
        return block * w.unsqueeze(1).unsqueeze(1)

    def hessian_sqrt(self, logits: Tensor, targets: Tensor, z: Tensor) -> Tensor:
        """``s = √w_y (√p ⊙ z − p (√p · z))`` per position, ``[S, N, C, *]``.

        ``B = diag(√p) − p √pᵀ`` gives ``B Bᵀ = diag p − 2 p pᵀ + p pᵀ Σ_c p_c = diag p − p pᵀ``:
        a square root of the softmax block without an eigendecomposition.

        Args:
            logits: ``[N, C, *]``, classes on dim 1.
            targets: Class indices ``[N, *]`` (or MONAI's ``[N, 1, *]``), integer dtype.
            z: ``[S, N, C, *]``, ``S`` vectors (e.g. standard normal).

        Returns:
            ``[S, N, C, *]``; ``E[s sᵀ]`` is the Hessian block when ``E[z zᵀ] = I``.

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        p = torch.softmax(logits, 1)
        root = p.sqrt()
        w = self._position_weight(logits, targets).sqrt().unsqueeze(1)
        return w * (root * z - p * (root * z).sum(2, keepdim=True))


class MSE(Loss):
    """Squared error ``ℓ = ½ Σ (f − y)²`` (laplace-torch's regression loss); Hessian ``1``.

    Args:
        reduction: ``"sum"`` or ``"mean"`` (divided by the number of entries).
        factor: The loss is ``factor · Σ (f − y)²`` and its Hessian ``2 · factor``; ``½`` by
            default, ``1`` for ``nn.MSELoss``.
    """

    link: ClassVar[str | None] = "identity"

    def __init__(self, reduction: Reduction = "sum", factor: float = 0.5):
        _check_reduction(reduction)
        if factor <= 0:
            raise ValueError(f"factor must be positive, got {factor}")
        self.reduction, self.factor = reduction, factor

    def check(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Validate regression targets: shaped like the outputs, finite.

        Args:
            logits: ``[N, *]``.
            targets: Real targets shaped like ``logits``.

        Returns:
            The targets in the logits' dtype.

        Raises:
            TargetShapeError: For a shape other than the outputs'.
            ValueError: For NaN or infinite targets.
        """
        if targets.shape != logits.shape:
            raise TargetShapeError(
                f"MSE targets of shape {tuple(targets.shape)} do not match the outputs' shape "
                f"{tuple(logits.shape)}"
            )
        if not (targets.is_floating_point() or targets.is_complex()):
            targets = targets.to(logits.dtype)
        if not bool(torch.isfinite(targets).all()):
            bad = ~torch.isfinite(targets)
            raise ValueError(
                f"MSE targets have {int(bad.sum())} non-finite (NaN or inf) entries, the first "
                f"at index {tuple(int(j) for j in bad.nonzero()[0])}; clean or mask them"
            )
        return targets.to(logits.dtype)

    def value(self, logits: Tensor, targets: Tensor) -> Tensor:
        """``ℓ = factor · Σ (f − y)²`` (``factor = ½``: laplace-torch's regression loss).

        Args:
            logits: ``[N, *]``.
            targets: Real targets shaped like ``logits``.

        Returns:
            The scalar loss (divided by the number of entries for ``reduction="mean"``).

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        targets = self.check(logits, targets)
        total = self.factor * (logits - targets).square().sum()
        return total / logits.numel() if self.reduction == "mean" else total

    def hessian_diag(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The constant Hessian ``2 · factor`` (``1`` by default): diagonal, exact.

        Args:
            logits: ``[N, *]``.
            targets: Real targets shaped like ``logits``.

        Returns:
            ``2 · factor`` everywhere, shaped like ``logits`` (divided by the number of
            entries for ``reduction="mean"``).

        Raises:
            ValueError: For targets that do not fit the logits (see :meth:`check`).
        """
        self.check(logits, targets)
        h = torch.full_like(logits, 2 * self.factor)
        return h / logits.numel() if self.reduction == "mean" else h


def _others(p: Tensor) -> Tensor:
    """``Σ_{l≠c} p_l`` over dim 1 for each ``c``, as sums of non-negative terms (no ``1 − p_c``).

    Exclusive prefix plus suffix sums: accurate where ``p_c`` rounds to 1.
    """
    zero = torch.zeros_like(p.narrow(1, 0, 1))
    prefix = torch.cat([zero, p.narrow(1, 0, p.shape[1] - 1).cumsum(1)], 1)
    rev = p.flip(1)
    suffix = torch.cat([zero, rev.narrow(1, 0, p.shape[1] - 1).cumsum(1)], 1).flip(1)
    return prefix + suffix


def check_batch(logits: Tensor, targets: Tensor, what: str) -> None:
    """Refuse targets that are not a tensor, and an empty batch."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"{what} targets must be a tensor, got {type(targets).__name__}")
    if logits.dim() > 0 and logits.shape[0] == 0:
        raise ValueError(f"empty batch: logits of shape {tuple(logits.shape)}")


_NAMES = {"bce": BCEWithLogits, "ce": CrossEntropy, "cross_entropy": CrossEntropy, "mse": MSE}


def as_loss(loss: str | Loss | nn.Module) -> Loss:
    """Turn a name, a :class:`Loss` or a ``torch.nn`` loss module into a :class:`Loss`.

    Names: ``"bce"``, ``"ce"`` (or ``"cross_entropy"``), ``"mse"``, all summed over the batch.
    Modules: ``nn.BCEWithLogitsLoss``, ``nn.CrossEntropyLoss`` and ``nn.MSELoss`` keep their own
    options and reduction (``nn.MSELoss`` is ``Σ (f − y)²``, Hessian ``2``).

    Args:
        loss: A name, a :class:`Loss` (returned as is) or a ``torch.nn`` loss module.

    Returns:
        The :class:`Loss`.

    Raises:
        ValueError: For an unknown name or ``reduction="none"``.
        TypeError: For any other object.
    """
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, str):
        try:
            return _NAMES[loss.lower()]()
        except KeyError:
            raise ValueError(f"unknown loss {loss!r}; use one of {sorted(_NAMES)}") from None
    if isinstance(loss, nn.modules.loss._Loss):
        if loss.reduction not in ("sum", "mean"):
            raise ValueError(
                f"{type(loss).__name__}(reduction={loss.reduction!r}) has no scalar curvature; "
                "use reduction='sum' or 'mean'"
            )
        if type(loss) is nn.BCEWithLogitsLoss:
            return BCEWithLogits(loss.pos_weight, loss.weight, loss.reduction)
        if type(loss) is nn.CrossEntropyLoss:
            return CrossEntropy(
                loss.weight, loss.ignore_index, loss.label_smoothing, loss.reduction
            )
        if type(loss) is nn.MSELoss:
            return MSE(loss.reduction, factor=1.0)
    raise TypeError(
        f"unsupported loss {loss!r}: use 'bce', 'ce', 'mse', a lsn_ext Loss, or "
        "nn.BCEWithLogitsLoss / nn.CrossEntropyLoss / nn.MSELoss"
    )
