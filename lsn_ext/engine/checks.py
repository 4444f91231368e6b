"""The engine's checks of inputs, outputs and results, shared with the estimators.

Each refuses a bad value with an error that names it (the parameter, the input, the index of
the first non-finite entry) and says what to do; :func:`all_finite` does the finiteness test of
many tensors with one host synchronisation. :func:`round_off` and :func:`sum_tolerance` give the
rounding the round-off checks scale with.
"""

from __future__ import annotations

import cmath
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "all_finite",
    "check_db_diagonals",
    "check_finite_logits",
    "check_finite_result",
    "check_inputs",
    "check_logits",
    "round_off",
    "select_params",
    "sum_tolerance",
]


def check_inputs(
    model: nn.Module,
    args: Sequence[Any],
    named_params: Sequence[tuple[str, Tensor]] | None = None,
) -> None:
    """Refuse non-finite weights (naming the parameter) and empty, non-finite or mistyped inputs.

    A single NaN pixel or weight would otherwise make every entry of the curvature NaN (or,
    for a NaN that is masked downstream, silently wrong). The weights and inputs are checked
    together with one host synchronisation (see :func:`all_finite`). ``named_params`` is
    ``model.named_parameters()`` where the caller has it already.

    Raises:
        RuntimeError: Under ``torch.inference_mode()`` (autograd cannot be switched on there).
        ValueError: Naming the parameter, or the input, the number of non-finite entries and
            the first one's index; an empty batch.
        TypeError: An integer input to a model without embeddings, or a floating input whose
            dtype differs from the parameters'.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "the curvature was asked for under torch.inference_mode(), which switches autograd "
            "off even inside torch.enable_grad(); call the fit (or this function) outside the "
            "inference_mode block (torch.no_grad() is fine)"
        )
    if named_params is None:
        named_params = list(model.named_parameters())
    floating = [(name, p) for name, p in named_params if p.is_floating_point()]
    dtypes = {p.dtype for _, p in floating}
    inputs = [(i, x) for i, x in enumerate(args) if isinstance(x, Tensor)]
    for i, x in inputs:
        if not (x.is_floating_point() or x.is_complex()) and dtypes and not _takes_indices(model):
            raise TypeError(
                f"input {i} has dtype {x.dtype}, but the model computes in "
                f"{', '.join(sorted(map(str, dtypes)))}; convert the images first, e.g. "
                "x.float() / 255"
            )
        if x.is_floating_point() and len(dtypes) == 1 and x.dtype not in dtypes:
            raise TypeError(
                f"input {i} has dtype {x.dtype} but the model's parameters are "
                f"{next(iter(dtypes))}; convert one of them (x.to(dtype) or model.to(dtype))"
            )
        if x.dim() > 0 and x.shape[0] == 0:
            raise ValueError(
                f"input {i} has an empty batch (shape {tuple(x.shape)}); pass at least one sample"
            )
    numeric = [(i, x) for i, x in inputs if x.is_floating_point() or x.is_complex()]
    finite = all_finite([p for _, p in floating] + [x for _, x in numeric])
    for (name, p), ok in zip(floating, finite[: len(floating)], strict=True):
        if not ok:
            bad = int((~torch.isfinite(p)).sum())
            raise ValueError(
                f"parameter '{name}' {tuple(p.shape)} has {bad} non-finite (NaN or inf) "
                "entries; the curvature of such a model is undefined. Check the training run "
                "(divergence?) or the checkpoint"
            )
    for (i, x), ok in zip(numeric, finite[len(floating) :], strict=True):
        if not ok:
            bad = ~torch.isfinite(x)
            where = tuple(int(j) for j in bad.nonzero()[0])
            raise ValueError(
                f"input {i} {tuple(x.shape)} has {int(bad.sum())} non-finite (NaN or "
                f"inf) entries, the first at index {where}; clean or mask the input"
            )


def _takes_indices(model: nn.Module) -> bool:
    """Whether the model has embeddings, which take integer inputs."""
    return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())


def check_finite_logits(f: Tensor) -> None:
    """Raise ``FloatingPointError`` when the model output has non-finite entries."""
    if not all_finite([f])[0]:
        bad = ~torch.isfinite(f)
        where = tuple(int(j) for j in bad.nonzero()[0])
        raise FloatingPointError(
            f"the model output {tuple(f.shape)} has {int(bad.sum())} non-finite entries, "
            f"the first at index {where}, although inputs and weights are finite: overflow in "
            f"{f.dtype} or non-finite buffers (e.g. batch-norm running statistics); check them, "
            "or compute in float64"
        )


def _to_host(values: list[Tensor]) -> list:
    """``tolist()`` of equally shaped small tensors with one host synchronisation for all.

    The tensors are stacked in their promoted dtype on the first one's device (not one
    synchronisation per parameter).
    """
    if not values:
        return []
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
    device = values[0].device
    return torch.stack([v.to(device, dtype) for v in values]).tolist()


def all_finite(tensors: list[Tensor]) -> list[bool]:
    """Per tensor, whether all its entries are finite, with one host synchronisation.

    One pass per tensor: its sum is non-finite if an entry is (NaN and ±inf propagate), so a
    finite sum proves the tensor finite. Only a tensor whose sum is not finite (a non-finite
    entry, or finite entries whose sum overflows) is then checked entry by entry. Half types
    are summed in float32.
    """
    sums = [t.detach().sum(dtype=torch.float32 if t.element_size() < 4 else None) for t in tensors]
    flags = [cmath.isfinite(total) for total in _to_host(sums)]
    return [ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, flags, strict=True)]


def check_finite_result(diagonals: dict[str, Tensor], dtype: torch.dtype, what: str) -> None:
    """Raise ``FloatingPointError`` naming the first parameter whose diagonal is not finite."""
    finite = all_finite(list(diagonals.values()))
    for name, ok in zip(diagonals, finite, strict=True):
        if not ok:
            raise FloatingPointError(
                f"the {what} diagonal of '{name}' is not finite (overflow in {dtype}); check the "
                "inputs and weights for extreme values, or compute in float64"
            )


def round_off(t: Tensor) -> float:
    """The relative rounding of arithmetic on ``t``: its dtype's ``eps``, or TF32's ``2⁻¹⁰``.

    On CUDA, float32 convolutions (and matrix products, where enabled) round their inputs to
    TF32's 10-bit mantissa by default (``torch.backends.cudnn.allow_tf32``), so two float32
    computations of the same quantity, a batched and a per-sample one, agree only to about
    ``2⁻¹⁰``, not to float32's ``2⁻²³``. The round-off checks scale with this number.
    """
    eps = torch.finfo(t.dtype).eps
    if t.dtype == torch.float32 and t.device.type == "cuda":
        backends = torch.backends
        if backends.cudnn.allow_tf32 or backends.cuda.matmul.allow_tf32:
            return max(eps, 2.0**-10)
    return eps


def sum_tolerance(u: float) -> float:
    """Relative tolerance for two sums of the same terms in a different order, at rounding ``u``.

    ``u`` is :func:`round_off` of the sums. ``10³ u`` in float64 and float32 (many terms,
    cancellation); ``16 u`` where ``u`` is that of TF32 or a half type, whose ``10³ u`` would be
    no check at all.
    """
    return 1e3 * u if u <= torch.finfo(torch.float32).eps else 16 * u


def check_db_diagonals(diagonals: dict[str, Tensor]) -> None:
    """Raise if a DB diagonal is not finite or has negative entries, naming the parameter.

    One ``aminmax`` per tensor and one host synchronisation for all: ``min`` and ``max`` are
    finite exactly when every entry is (NaN and ±inf propagate). Every DB step maps
    non-negative diagonals to non-negative ones, so a negative entry (beyond rounding:
    ``64 eps`` of the tensor's largest entry) means an operation was propagated with ``J``
    instead of ``J²``: a bug, or an unsupported operation that slipped through.

    Raises:
        FloatingPointError: A non-finite entry (overflow).
        RuntimeError: A negative entry.
    """
    named = {name: d.detach() for name, d in diagonals.items() if d.numel() > 0}
    flat = _to_host([v for d in named.values() for v in torch.aminmax(d)])
    for (name, d), lo, hi in zip(named.items(), flat[::2], flat[1::2], strict=True):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise FloatingPointError(
                f"the DB diagonal of '{name}' is not finite (overflow in {d.dtype}); check the "
                "inputs and weights for extreme values, or compute in float64"
            )
        if lo < -64 * round_off(d) * max(hi, -lo):
            raise RuntimeError(
                f"the DB diagonal of '{name}' has negative entries (smallest {lo:.3g}): a GGN "
                "diagonal is non-negative, so an operation in forward was propagated with its "
                "Jacobian instead of its square. Please report the model; meanwhile use the "
                "Monte-Carlo estimator (estimator='mc'), which needs no rules"
            )


def check_logits(logits: Any) -> None:
    """Raise a clear error unless the model returned one tensor of logits that needs grad.

    Raises:
        TypeError: A tuple, list or dict output (deep supervision, auxiliary heads), naming what
            came back and how to wrap the model.
        ValueError: Logits that depend on no parameter with ``requires_grad``.
    """
    if not isinstance(logits, Tensor):
        if isinstance(logits, (tuple, list)):
            what = f"a {type(logits).__name__} of {len(logits)} outputs"
            pick = "0"
        elif isinstance(logits, dict):
            what = f"a dict with keys {sorted(map(str, logits))}"
            pick = "'<key>'"
        else:
            what = type(logits).__name__
            pick = "<key>"
        raise TypeError(
            f"the model returned {what}; the curvature needs one tensor of logits [N, C, *]. "
            "Deep supervision or auxiliary heads return several: switch them off "
            "(deep_supervision=False) or wrap the model so that it returns the full-resolution "
            f"logits, lsn_ext.SelectOutput(model, {pick}), and use the wrapper everywhere "
            "(Laplace(...), predict)"
        )
    if not logits.requires_grad:
        raise ValueError("the model output does not depend on any parameter that requires grad")


def select_params(
    model: nn.Module,
    params: Sequence[Tensor] | None,
    named_params: Sequence[tuple[str, Tensor]] | None = None,
) -> tuple[list[str], list[Tensor]]:
    """Names and tensors of ``params`` (default: all with ``requires_grad``), in model order.

    ``named_params`` is ``model.named_parameters()`` where the caller has it already.
    """
    if named_params is None:
        named_params = list(model.named_parameters())
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if params is None:
        if not named:
            raise ValueError("the model has no parameter with requires_grad=True")
        return [n for n, _ in named], [p for _, p in named]
    wanted = {id(p) for p in params}
    all_ids = {id(p) for p in model.parameters()}
    if not wanted <= all_ids:
        raise ValueError("params contains tensors that are not parameters of the model")
    chosen = [(n, p) for n, p in named if id(p) in wanted]
    if len(chosen) != len(wanted):
        raise ValueError("every parameter in params must have requires_grad=True")
    return [n for n, _ in chosen], [p for _, p in chosen]
