"""The native diagonal-backprop engine: DB on an ordinary ``nn.Module``.

``diag_backprop(model, inputs, targets, loss)`` runs one forward pass in which

- every module with a rule in :data:`lsn_ext.rules.RULES` runs as one node of a custom autograd
  function whose backward applies that rule (the module's parameters are inputs of the node, so
  their DB diagonals arrive as the "gradients" of one ``torch.autograd.grad`` call, summed over
  repeated calls of a shared module);
- layers whose Jacobian has only 0/1 entries (ReLU, max pooling, flatten, dropout in evaluation
  mode) and structural operations in ``forward`` (``torch.cat``, slicing, reshapes, padding,
  addition, nearest upsampling) are left to autograd: squaring their Jacobian changes nothing, so
  the ordinary backward pass already is the DB step. Fan-out sums, which gives LSN Eq. (27) for
  concatenating skip connections, nested or not;
- a ``TorchFunctionMode`` inspects every other operation in ``forward`` that touches the graph:
  functional activations (``torch.tanh(x)``), constant scaling (``0.5 * x``, ``x / c``, ``-x``,
  ``a - b``, ``x.mean()``), ``F.interpolate`` and ``F.avg_pool*d`` are routed through the same
  rules; anything else raises an error naming the operation and the module it is called in.

Granularity: the diagonal is taken after every registered module and every functional operation
above; a module's internals are one layer. ``Conv2d(padding_mode="reflect")`` is padding followed
by a convolution (see :class:`~lsn_ext.rules.ConvRule`).

The model is left as found: forward hooks and per-instance ``forward`` overrides are installed for
the duration of the call only and removed in a ``finally`` block; parameters, buffers, modes and
``requires_grad`` flags are not touched.
"""

from __future__ import annotations

import cmath
import functools
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch._C import (
    _get_function_stack_at,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lsn_ext.rules import (
    RULES,
    AvgPoolRule,
    Rule,
    UpsampleRule,
    get_rule,
    register_adapters_for,
)
from lsn_ext.rules.elementwise import scale_forward_rule, scale_rule
from lsn_ext.rules.losses import CrossEntropy, Loss, as_loss
from lsn_ext.rules.product import product_forward_rule, product_rule

__all__ = ["DiagBackpropResult", "check_logits", "diag_backprop"]


@dataclass
class DiagBackpropResult:
    """What :func:`diag_backprop` returns.

    Attributes:
        loss: The loss on the batch (detached scalar).
        logits: The model output (detached), ``[N, C, *]`` or ``[N, K]``.
        diagonals: Parameter name → DB diagonal of the GGN, shaped like the parameter, in
            ``model.named_parameters()`` order (or the estimate of
            :func:`~lsn_ext.ggn_diagonal`'s other estimators).
        scales: For ``ggn_diagonal(..., estimator="db_calibrated")``: parameter name → the
            factor ``c_ℓ`` that rescaled DB's diagonal (``NaN`` where DB's trace is zero and the
            Monte-Carlo estimate was used instead); ``None`` otherwise.
        mc_paths: For the Monte-Carlo estimator (``"mc"``, ``"db_calibrated"``): parameter
            name → how its per-sample gradients were taken: ``"module"`` (captured at the leaf
            module that holds it), ``"block '<path>'"`` (the enclosing module replayed whole
            per sample, where the leaf's capture cannot serve) or ``"model"`` (the whole model
            per sample with ``torch.func``). The estimate means the same on every path; only
            the cost differs. ``None`` for DB.
    """

    loss: Tensor
    logits: Tensor
    diagonals: dict[str, Tensor]
    scales: dict[str, Tensor] | None = None
    mc_paths: dict[str, str] | None = None

    @property
    def vector(self) -> Tensor:
        """The diagonals flattened and concatenated in ``model.parameters()`` order."""
        return torch.cat([d.reshape(-1) for d in self.diagonals.values()])


def diag_backprop(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """Diagonal backpropagation of the GGN for one batch.

    Computes ``Σ_n D(J_nᵀ H_n J_n)`` with ``D`` applied after every layer (LSN paper Eq. 22),
    where ``H_n`` is the Hessian of ``loss`` w.r.t. the logits of sample ``n``. Cost: one forward
    and one backward pass, linear in the number of pixels.

    For cross-entropy, ``ce_first_step="exact"`` (default) propagates the full per-position
    ``C×C`` block ``diag(p) − p pᵀ`` through the output layer, ``m = D(J_lastᵀ H J_last)``, and
    applies ``D`` from there on. Starting from ``D(H)`` instead (``"diag"``) drops the negative
    ``−p pᵀ`` terms and badly overestimates the curvature when the head mixes shared features
    into all classes; it is offered for comparison. The exact step needs the logits to be the
    output of a ``Linear`` or convolution module.

    Args:
        model: Any ``nn.Module`` built from supported modules (see
            :func:`lsn_ext.rules.supported_modules`) and structural operations.
        inputs: The model input, or a sequence of inputs passed as ``model(*inputs)``.
        targets: Targets for ``loss`` (class indices ``[N, *]`` for cross-entropy).
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.rules.losses.Loss`, or a
            ``torch.nn`` loss (see :func:`~lsn_ext.rules.losses.as_loss`). Summed over the batch
            by default, as in laplace-torch.
        ce_first_step: ``"exact"`` or ``"diag"``, see above (cross-entropy only).
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and the diagonal per parameter.

    Raises:
        NotImplementedError: A module without a rule, or an operation in ``forward`` that DB
            cannot propagate through; the message names it and where it is.
        ValueError: Bad arguments, shapes or targets (NaN included); non-finite weights
            (naming the parameter) or inputs; an empty batch; a module in a mode without a
            valid rule (dropout or batch norm in training mode).
        TypeError: An integer input, or one whose dtype differs from the parameters'.
        FloatingPointError: Non-finite logits or diagonals (overflow), naming the parameter.
    """
    loss_fn = as_loss(loss)
    if ce_first_step not in ("exact", "diag"):
        raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
    named_params = list(model.named_parameters())
    names, chosen = select_params(model, params, named_params)
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    check_inputs(model, args, named_params)

    session = Session(model)
    with torch.enable_grad(), session:
        logits = model(*args)
    check_logits(logits)
    session.check_graph(logits, args)
    f = logits.detach()
    check_finite_logits(f)
    value = loss_fn.value(f, targets)
    # DB is linear in m. Squared derivatives shrink m quickly (saturated tanh: (1 − y²)² below
    # 1e-38), and float32 subnormals are ~10× slower on CPUs; a power-of-two scale keeps m in the
    # normal range and is undone exactly at the end.
    scale = 2.0 ** (math.frexp(torch.finfo(f.dtype).max)[1] // 4)
    h_diag = loss_fn.hessian_diag(f, targets).contiguous() * scale
    if isinstance(loss_fn, CrossEntropy) and ce_first_step == "exact":
        block = loss_fn.hessian_block(f, targets) * scale
        session.blocks.value = (session.head_indices(logits), block)
    try:
        grads = torch.autograd.grad(logits, chosen, grad_outputs=h_diag, allow_unused=True)
    except RuntimeError as err:
        if "modified by an inplace operation" not in str(err):
            raise
        raise RuntimeError(
            "an in-place operation in forward modified a tensor that diagonal backprop needs "
            "(the output of a Tanh or Sigmoid, or the input of a layer with a rule); write that "
            f"operation out of place. PyTorch reported: {err}"
        ) from None
    finally:
        session.blocks.value = None
    # One multi-tensor kernel undoes the scale (exactly: a power of two).
    found = [g for g in grads if g is not None]
    unscaled = iter(torch._foreach_div(found, scale) if found else ())
    diagonals = {
        n: torch.zeros_like(p) if g is None else next(unscaled)
        for n, p, g in zip(names, chosen, grads, strict=True)
    }
    check_db_diagonals(diagonals)
    return DiagBackpropResult(loss=value.detach(), logits=f, diagonals=diagonals)


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


class _Blocks:
    """The loss Hessian's block for the head calls of one DB pass (see ``Session.head_indices``).

    Rule nodes reach it through their :class:`_Call`; it holds no reference to the session or
    to the graph, so the graph never takes part in a reference cycle (Python's garbage collector
    cannot free cycles that run through autograd's C++ nodes: each call would leak its graph).
    """

    def __init__(self) -> None:
        self.value: tuple[set[int], Tensor] | None = None

    def take(self, index: int) -> Tensor | None:
        """The block for the head call ``index``, once; ``None`` for every other call."""
        if self.value is not None and index in self.value[0]:
            self.value[0].discard(index)
            return self.value[1]
        return None


@dataclass(eq=False)
class _Call:
    """One application of a rule in the forward pass.

    Deliberately without a reference to the session (see :class:`_Blocks`).
    """

    forward_mode: bool
    blocks: _Blocks
    module: nn.Module
    rule: Rule
    run: Callable[[Tensor], Tensor]
    index: int
    param_names: tuple[str, ...]
    flags: _Flags


@dataclass(frozen=True)
class _Flags:
    """What a rule node keeps for backward: the input, the output; whether the layer is in place."""

    keep_x: bool
    keep_y: bool
    inplace: bool

    @classmethod
    def of(cls, module: nn.Module, rule: Rule) -> _Flags:
        # Not getattr(module, "inplace", False) alone: a module without the attribute raises
        # (and formats) an AttributeError in nn.Module.__getattr__, on every module and call.
        has = "inplace" in module.__dict__ or hasattr(type(module), "inplace")
        inplace = has and bool(module.inplace)
        return cls(rule.reads_input(module), rule.reads_output(module), inplace)


class _RuleFunction(torch.autograd.Function):
    """Runs a layer in forward and its DB rule in backward; params are inputs 2, 3, and so on.

    In a forward-mode session (:func:`lsn_ext.forward.linearized_variance`) the tangents are
    variances and :meth:`jvp` applies the rule's squared forward step instead.
    """

    @staticmethod
    def forward(ctx, call: _Call, x: Tensor, *params: Tensor):
        fwd = call.forward_mode
        keep_x, keep_y = call.flags.keep_x, call.flags.keep_y
        x_in = x.clone() if (keep_x or fwd) and call.flags.inplace else x
        y = call.run(x)
        if y is x:
            ctx.mark_dirty(x)
        elif y._is_view():
            # InstanceNorm returns a view; autograd forbids in-place changes of a custom
            # Function's view outputs (an in-place activation follows in MONAI and nnU-Net).
            # A detached alias shares storage and version counter but is no view.
            y = y.detach()
        ctx.call = call
        ctx.save_for_backward(x_in if keep_x else None, y if keep_y else None)
        # For the meta placeholder of a tensor the rule does not read (the output's is m_out's).
        ctx.x_like = None if keep_x else (x.shape, x.dtype)
        if fwd:
            # Not ctx.save_for_forward: it keeps the output on the node, and the output keeps
            # the node (a cycle through C++ that leaks the graph). jvp runs once, right after
            # forward, and drops them.
            ctx.for_jvp = (x_in, y)
            ctx.set_materialize_grads(False)  # absent tangents (zero variance) arrive as None
            ctx.in_place = y is x
        return y

    @staticmethod
    def jvp(ctx, _call_tangent: None, v_in: Tensor | None, *param_vars: Tensor | None):
        """``v_out = rule.forward_rule(...)``: the tangents are variances, not perturbations."""
        call: _Call = ctx.call
        if not call.forward_mode:
            raise RuntimeError(
                "forward-mode AD through diag_backprop is not supported; for the linearised "
                "variance use lsn_ext.forward.linearized_variance"
            )
        x, y = ctx.for_jvp
        del ctx.for_jvp
        var = {n: v for n, v in zip(call.param_names, param_vars, strict=True) if v is not None}
        # No grad: the session's TorchFunctionMode must not route the rule's own operations.
        with torch.no_grad():
            v_out = call.rule.forward_rule(call.module, x, y, v_in, var)
            if ctx.in_place:
                # Forward AD requires an in-place layer to update its input's tangent in place;
                # an input without one has zero variance, and so has a parameter-free output.
                return None if v_in is None else v_in.copy_(v_out)
        return v_out

    @staticmethod
    def backward(ctx, m_out: Tensor):
        call: _Call = ctx.call
        x, y = ctx.saved_tensors
        if x is None:
            x = torch.empty(ctx.x_like[0], dtype=ctx.x_like[1], device="meta")
        if y is None:
            y = torch.empty(m_out.shape, dtype=m_out.dtype, device="meta")
        need_input = ctx.needs_input_grad[1]
        need_params = any(ctx.needs_input_grad[2:])
        block = call.blocks.take(call.index)
        if block is None:
            m_in, diags = call.rule.backward(call.module, x, y, m_out, need_input, need_params)
        else:
            m_in = call.rule.input_rule_block(call.module, x, y, block) if need_input else None
            _, diags = call.rule.backward(call.module, x, y, m_out, False, need_params)
        grads = (
            diags.get(name) if ctx.needs_input_grad[2 + i] else None
            for i, name in enumerate(call.param_names)
        )
        return None, m_in, *grads


class _ScaleFunction(torch.autograd.Function):
    """``y = compute()`` with ``y = c · x``; backward is :func:`scale_rule`."""

    @staticmethod
    def forward(ctx, x: Tensor, c: Tensor | float, compute: Callable[[], Tensor]):
        ctx.c, ctx.shape = c, x.shape
        return compute()

    @staticmethod
    def backward(ctx, m_out: Tensor):
        return scale_rule(m_out, ctx.c, ctx.shape), None, None

    @staticmethod
    def jvp(ctx, v_in: Tensor, _c_tangent: None, _compute_tangent: None):
        """Forward-mode session: ``v_out = c² · v_in`` (:func:`scale_forward_rule`)."""
        c = ctx.c
        shape = torch.broadcast_shapes(ctx.shape, c.shape if isinstance(c, Tensor) else ())
        with torch.no_grad():
            return scale_forward_rule(v_in, c, shape)


class _ProductFunction(torch.autograd.Function):
    """``y = compute()`` with ``y = a ⊙ b``, both factors in the graph.

    Backward is :func:`~lsn_ext.rules.product.product_rule`.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, compute: Callable[[], Tensor]):
        ctx.save_for_backward(a, b)
        ctx.save_for_forward(a, b)
        ctx.set_materialize_grads(False)  # absent tangents (zero variance) arrive as None
        return compute()

    @staticmethod
    def backward(ctx, m_out: Tensor | None):
        if m_out is None:
            return None, None, None
        a, b = ctx.saved_tensors
        m_a, m_b = product_rule(m_out, a, b)
        return m_a, m_b, None

    @staticmethod
    def jvp(ctx, v_a: Tensor | None, v_b: Tensor | None, _compute_tangent: None):
        """Forward-mode session: ``v_y = b² v_a + a² v_b`` (:func:`product_forward_rule`)."""
        a, b = ctx.saved_tensors
        with torch.no_grad():
            return product_forward_rule(v_a, v_b, a, b)


class Session(TorchFunctionMode):
    """State of one DB forward pass: installs and removes everything on ``model``."""

    def __init__(self, model: nn.Module, *, forward_mode: bool = False):
        super().__init__()
        self.model = model
        # True for the forward (linearised variance) pass: rule nodes save what jvp needs.
        self.forward_mode = forward_mode
        self._paths: dict[int, str] | None = None
        self.counter = itertools.count()
        self.blocks = _Blocks()
        self._handles: list[Any] = []
        self._patched: list[tuple[nn.Module, Any]] = []

    # -- installation --------------------------------------------------------------------------

    def __enter__(self):
        try:
            modules = all_modules(self.model)
            register_adapters_for(modules)
            for module in modules:
                if is_parametrized(module):
                    raise NotImplementedError(_parametrized_message(self.describe(module), module))
                rule = RULES.get(type(module))
                if rule is None:
                    if not module._modules and any(
                        p is not None for p in module._parameters.values()
                    ):
                        hook = module.register_forward_pre_hook(self._refuse)
                        self._handles.append(hook)
                    continue
                if "forward" in module.__dict__:
                    raise NotImplementedError(
                        f"{self.describe(module)} has its forward replaced on the instance; the "
                        f"rule for {type(module).__name__} describes the class's forward, not "
                        "the replacement. Remove the override (subclass instead and register a "
                        "rule for the subclass with lsn_ext.register_rule), or use the "
                        "Monte-Carlo estimator (estimator='mc')"
                    )
                if type(rule).check is not Rule.check:
                    self._handles.append(module.register_forward_pre_hook(self._check))
                if not rule.is_autograd_exact(module):
                    self._patch(module, rule)
            return super().__enter__()
        except BaseException:
            self._uninstall()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._uninstall()

    def _uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, previous in self._patched:
            if previous is None:
                object.__delattr__(module, "forward")
            else:
                object.__setattr__(module, "forward", previous)
        self._handles.clear()
        self._patched.clear()

    def _patch(self, module: nn.Module, rule: Rule) -> None:
        previous = module.__dict__.get("forward")
        run_original = previous if previous is not None else type(module).forward.__get__(module)
        own = tuple(n for n, p in module._parameters.items() if p is not None)
        flags = _Flags.of(module, rule)

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
                raise TypeError(
                    f"{self.describe(module)} was called with {len(args)} positional and "
                    f"{len(kwargs)} keyword arguments; its rule takes one tensor input"
                )
            x = args[0]
            # The rule describes everything the module computes: the session's mode has nothing
            # to inspect in it, and each tensor attribute it would route costs a Python call.
            with ModeAside(self):
                params = [module._parameters[n] for n in own]
                if x.requires_grad or any(p.requires_grad for p in params):
                    return self.apply_rule(module, rule, x, run_original, own, params, flags)
            return run_original(x)

        # A plain instance attribute shadows the class's forward; nn.Module.__setattr__ is
        # bypassed because a function is neither a parameter, a buffer nor a module.
        object.__setattr__(module, "forward", forward)
        self._patched.append((module, previous))

    # -- forward-pass bookkeeping ---------------------------------------------------------------

    def _check(self, module: nn.Module, args: Any) -> None:
        """Pre-hook: the rule refuses the module's current mode (e.g. training mode)."""
        try:
            RULES[type(module)].check(module)
        except ValueError as err:
            raise ValueError(f"{self.describe(module)}: {err}") from None

    def check_graph(self, logits: Tensor, args: tuple) -> None:
        """Refuse ``torch.autograd.Function`` nodes in the graph that DB has no rule for.

        A custom Function's forward runs with grad disabled, so the session never sees its
        operations, and its backward multiplies DB's diagonal by ``J`` instead of ``J²``:
        silently wrong curvature. (Functions inside a module with a rule run within that rule's
        node and leave no node of their own.)

        Raises:
            NotImplementedError: Naming the Function, the module it was called in, and the
                alternatives.
        """
        seen: set[int] = set()
        nodes = [logits.grad_fn]
        while nodes:
            node = nodes.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if _is_foreign_function(node):
                cls = node._forward_cls
                if cls.__module__.startswith("torch._functorch._aot_autograd"):
                    raise NotImplementedError(self._compiled_message())
                module = self._function_module(cls, args)
                where = "the model's forward" if module is None else self.describe(module)
                if cls.__name__ == "CheckpointFunction":
                    raise NotImplementedError(
                        f"{where} uses torch.utils.checkpoint (reentrant), which diagonal "
                        "backprop cannot see into. Switch checkpointing off for the curvature, "
                        "or use the Monte-Carlo estimator (estimator='mc') with "
                        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
                    )
                raise NotImplementedError(
                    f"Diagonal backprop cannot propagate through the torch.autograd.Function "
                    f"'{cls.__module__}.{cls.__qualname__}' called in {where}: its backward "
                    "multiplies by the Jacobian, DB needs its square, and its forward is hidden "
                    "from DB. Put it in a module of your own and register a rule for that "
                    "module with lsn_ext.register_rule (or replace it by its plain torch "
                    "operations, e.g. a memory-efficient swish by nn.SiLU), or use the "
                    "Monte-Carlo estimator (estimator='mc'), which needs no rules"
                )
            nodes.extend(n for n, _ in node.next_functions)

    def _compiled_message(self) -> str:
        """The refusal of a ``torch.compile`` graph, naming the compiled modules (error path)."""
        from torch._dynamo.eval_frame import OptimizedModule

        compiled = [
            "the model" if not name else f"{name!r}"
            for name, m in self.model.named_modules()
            if isinstance(m, OptimizedModule)
        ]
        where = (
            f"{', '.join(compiled)} (compiled by torch.compile)"
            if compiled
            else "a function compiled by torch.compile in the model's forward"
        )
        return (
            f"{where} runs as one torch.autograd.Function, whose operations diagonal backprop "
            "cannot see. Pass the uncompiled module for the curvature (torch.compile(module) "
            "keeps it as ._orig_mod, with the same parameters, e.g. model._orig_mod), or use "
            "the Monte-Carlo estimator (estimator='mc')"
        )

    def _function_module(self, cls: type, args: tuple) -> nn.Module | None:
        """The innermost module whose output a ``cls`` Function made (error path only).

        Runs the model's forward once more, with a forward hook on every module: the error
        costs a forward pass, so that every successful call pays for no hooks.
        """
        found: list[nn.Module] = []

        def record(module: nn.Module, _args: Any, out: Any) -> None:
            for t in tree_leaves(out):
                node = t.grad_fn if isinstance(t, Tensor) else None
                if not found and _is_foreign_function(node) and node._forward_cls is cls:
                    found.append(module)

        handles = [m.register_forward_hook(record) for m in self.model.modules()]
        try:
            with torch.enable_grad():
                self.model(*args)
        except Exception:  # the forward's own failure: the message names no module
            return None
        finally:
            for handle in handles:
                handle.remove()
        return found[0] if found else None

    def _refuse(self, module: nn.Module, args: Any) -> None:
        """Pre-hook on a parametric leaf module without a rule: raise the registry's error."""
        get_rule(module, self.path(module))

    def current_module(self) -> nn.Module | None:
        """The innermost module of the model whose code is running (for error messages).

        Found by walking the Python frames, so the forward pass pays nothing for it.
        """
        self.path(self.model)
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in self._paths:
                return owner
            frame = frame.f_back
        return None

    def path(self, module: nn.Module) -> str:
        """The module's dotted path in the model (computed on first use: errors only)."""
        if self._paths is None:
            self._paths = {}
            for name, m in self.model.named_modules(remove_duplicate=False):
                self._paths.setdefault(id(m), name or "<model>")
        return self._paths.get(id(module), "?")

    def describe(self, module: nn.Module) -> str:
        """``'path' (Class)`` for error messages."""
        return f"'{self.path(module)}' ({type(module).__name__})"

    def apply_rule(
        self,
        module: nn.Module,
        rule: Rule,
        x: Tensor,
        run: Callable[[Tensor], Tensor],
        param_names: tuple[str, ...] = (),
        params: Sequence[Tensor] = (),
        flags: _Flags | None = None,
    ) -> Tensor:
        """Run ``run(x)`` as one DB node with ``rule``.

        Raises:
            NotImplementedError: Inside non-reentrant ``torch.utils.checkpoint`` (backward
                passes only), naming the module.
        """
        if not self.forward_mode and _in_non_reentrant_checkpoint():
            raise NotImplementedError(
                f"{self.describe(module)} runs inside torch.utils.checkpoint "
                "(use_reentrant=False), whose recomputation in the backward pass replaces the "
                "tensors diagonal backprop saves for its rules. Switch checkpointing off for the "
                "curvature, or use the Monte-Carlo estimator (estimator='mc'), which supports "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        call = _Call(
            self.forward_mode,
            self.blocks,
            module,
            rule,
            run,
            next(self.counter),
            param_names,
            flags or _Flags.of(module, rule),
        )
        return _RuleFunction.apply(call, x, *params)

    def head_indices(self, logits: Tensor) -> set[int]:
        """Indices of the rule calls whose outputs sum to ``logits``; each must have a block rule.

        The logits are the output of a Linear or convolution head, or a sum of such outputs
        (MONAI's residual units end in ``conv(x) + residual(x)``). Each head then gets the
        per-position block of the loss Hessian; the cross terms between summed heads are
        dropped, as DB drops them at every fan-out.

        Raises:
            ValueError: If anything else produced the logits, naming it.
        """
        found: set[int] = set()
        nodes = [logits.grad_fn]
        while nodes:
            node = nodes.pop()
            call = getattr(node, "call", None)
            if isinstance(call, _Call) and call.rule.has_block_rule():
                found.add(call.index)
            elif node is not None and type(node).__name__ == "AddBackward0":
                nodes.extend(n for n, _ in node.next_functions if n is not None)
            else:
                raise ValueError(
                    "the exact cross-entropy first step needs the logits to be the output of a "
                    "Linear or convolution module (or a sum of such outputs), but they come from "
                    f"{self._origin(node)}. Make the head the last operation of forward, pass "
                    "ce_first_step='diag' (starts from diag(H), which overestimates the "
                    "curvature), or use the Monte-Carlo estimator (estimator='mc'), which needs "
                    "neither"
                )
        return found

    def _origin(self, node: Any) -> str:
        """What produced a node of the graph, for error messages."""
        if node is None:
            return "no operation"
        call = getattr(node, "call", None)
        if not isinstance(call, _Call):
            return type(node).__name__
        if self.path(call.module) != "?":
            return self.describe(call.module)
        return f"a functional {type(call.module).__name__.lower()} in forward"

    # -- functional operations ------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if not torch.is_grad_enabled() or name in _PASS_THROUGH:
            return func(*args, **kwargs)
        handler = _HANDLERS.get(name)
        if handler is not None and _needs_grad((args, kwargs)):
            return handler(self, func, args, kwargs)
        out = func(*args, **kwargs)
        if name not in _STRUCTURAL and _needs_grad(out):
            raise self.unsupported(name or repr(func))
        return out

    def unsupported(self, name: str, detail: str = "") -> NotImplementedError:
        """The error for an operation in ``forward`` that DB cannot propagate through."""
        module = self.current_module()
        where = "the model" if module is None else self.describe(module)
        return NotImplementedError(
            f"Diagonal backprop cannot propagate through '{name}' in the forward of {where}: "
            "its Jacobian has entries other than 0 and 1 and no rule covers it."
            f"{' ' + detail if detail else ''} Outside modules, forward may use structural "
            "operations (cat, stack, slicing, reshapes, pad, add, sum, relu, max pooling, "
            "nearest interpolation), scaling by constants (c * x, x / c, -x, a - b, mean), "
            f"the functional activations {sorted(_ACTIVATIONS)}, F.avg_pool*d and "
            "F.interpolate, and products of two branches (a * b). Use a supported module, put "
            "the operation in a module of your own and register a rule for it with "
            "lsn_ext.register_rule, or use the Monte-Carlo estimator (estimator='mc' in "
            "lsn_ext.ggn_diagonal and DiagBackprop, their default), which needs no rules."
        )


class ModeAside:
    """Context: ``mode`` off the torch-function mode stack, if on top, while our own code runs.

    For code of the library's own (a rule node, a hook) inside a forward pass under a mode that
    has nothing to inspect there: every tensor operation and attribute read would otherwise be
    routed through the mode's Python ``__torch_function__``.
    """

    __slots__ = ("mode", "popped")

    def __init__(self, mode: TorchFunctionMode):
        self.mode = mode
        self.popped = False

    def __enter__(self) -> None:
        depth = _len_torch_function_stack()
        if depth and _get_function_stack_at(depth - 1) is self.mode:
            _pop_torch_function_stack()
            self.popped = True

    def __exit__(self, *exc: object) -> None:
        if self.popped:
            _push_on_torch_function_stack(self.mode)
            self.popped = False


def _identity_functions() -> tuple[type, ...]:
    """The identity Functions of torch itself, inserted by full backward hooks (BackPACK)."""
    from torch.nn.modules import _functions

    hook = getattr(_functions, "BackwardHookFunction", None)
    return (hook,) if hook is not None else ()


def all_modules(model: nn.Module) -> list[nn.Module]:
    """``list(model.modules())``: each module once, in pre-order.

    Without the nested generators of ``named_modules``, which cost about 1 µs per module and
    level on every call.
    """
    seen: set[int] = set()
    found: list[nn.Module] = []
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed([c for c in module._modules.values() if c is not None]))
    return found


def is_parametrized(module: nn.Module) -> bool:
    """``parametrize.is_parametrized`` without its ``getattr`` (an exception per plain module)."""
    holder = module._modules.get("parametrizations")
    return isinstance(holder, nn.ModuleDict) and parametrize.is_parametrized(module)


def _parametrized_message(where: str, module: nn.Module) -> str:
    """Why DB refuses a module with ``torch.nn.utils.parametrize`` parametrizations."""
    names = ", ".join(sorted(module.parametrizations.keys()))
    return (
        f"{where} has parametrized tensors ({names}: weight_norm, spectral_norm or another "
        "torch.nn.utils.parametrize parametrization). DB's rules act on a module's own "
        "parameters and cannot reach the parametrization's (original0, original1, …): even "
        "with a rule registered for the class they would get zero curvature. Remove the "
        "parametrization for the curvature (torch.nn.utils.parametrize."
        f"remove_parametrizations(module, {names.split(', ')[0]!r}) keeps the function), or "
        "use the Monte-Carlo estimator (estimator='mc')"
    )


def _in_non_reentrant_checkpoint() -> bool:
    """Whether a non-reentrant ``torch.utils.checkpoint`` region packs the saved tensors now.

    Such a region drops the tensors saved in forward and recomputes them in backward by the
    plain modules, without DB's rules: DB's rules would get other tensors than they saved (torch
    compares only shapes, dtypes and devices, and raises a ``CheckpointError`` where they differ).
    Not queried while dynamo traces (it cannot trace the query).
    """
    if torch.compiler.is_compiling():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def _is_foreign_function(node: Any) -> bool:
    """Whether a graph node is a ``torch.autograd.Function`` that DB cannot propagate through.

    That is any custom Function but this module's rule nodes and torch's identities.
    """
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    return node._forward_cls not in _known_functions()


@functools.cache
def _known_functions() -> tuple[type, ...]:
    """This module's rule nodes and torch's identities (see :func:`_is_foreign_function`)."""
    return (_RuleFunction, _ScaleFunction, _ProductFunction, *_identity_functions())


def _inplace(name: str) -> bool:
    """``mul_`` is in place; ``__rsub__`` is not."""
    return name.endswith("_") and not name.endswith("__")


def _needs_grad(tree: Any) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(tree))


def bind_arguments(args: tuple, kwargs: dict, spec: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Bind ``(input, *rest)`` to ``spec``'s names with defaults."""
    bound = {"input": args[0] if args else kwargs["input"]}
    for (name, default), value in itertools.zip_longest(spec, args[1:], fillvalue=_MISSING):
        if name is _MISSING:
            raise TypeError("too many positional arguments")
        bound[name] = value if value is not _MISSING else kwargs.get(name, default)
    return bound


_MISSING = object()

# Functional activations: name → (argument spec, module with the same computation). An
# in-place call (``F.silu(x, inplace=True)``, as in MONAI's EfficientNet blocks) runs as the
# in-place module, which the rule node handles like ``nn.SiLU(inplace=True)``.
_ACTIVATIONS: dict[str, tuple[tuple[tuple[str, Any], ...], Callable[..., nn.Module]]] = {
    "tanh": ((), lambda: nn.Tanh()),
    "sigmoid": ((), lambda: nn.Sigmoid()),
    "leaky_relu": (
        (("negative_slope", 0.01), ("inplace", False)),
        lambda negative_slope, inplace: nn.LeakyReLU(negative_slope, inplace),
    ),
    "elu": ((("alpha", 1.0), ("inplace", False)), lambda alpha, inplace: nn.ELU(alpha, inplace)),
    "celu": ((("alpha", 1.0), ("inplace", False)), lambda alpha, inplace: nn.CELU(alpha, inplace)),
    "selu": ((("inplace", False),), lambda inplace: nn.SELU(inplace)),
    "silu": ((("inplace", False),), lambda inplace: nn.SiLU(inplace)),
    "mish": ((("inplace", False),), lambda inplace: nn.Mish(inplace)),
    "hardswish": ((("inplace", False),), lambda inplace: nn.Hardswish(inplace)),
    "hardsigmoid": ((("inplace", False),), lambda inplace: nn.Hardsigmoid(inplace)),
    "gelu": ((("approximate", "none"),), lambda approximate: nn.GELU(approximate)),
    "softplus": (
        (("beta", 1.0), ("threshold", 20.0)),
        lambda beta, threshold: nn.Softplus(beta, threshold),
    ),
}


def _activation(session: Session, func, args, kwargs) -> Tensor:
    spec, factory = _ACTIVATIONS[func.__name__]
    bound = bind_arguments(args, kwargs, spec)
    module = factory(**{k: v for k, v in bound.items() if k != "input"})
    return session.apply_rule(module, RULES[type(module)], bound["input"], module)


_POOL_SPEC = (
    ("kernel_size", None),
    ("stride", None),
    ("padding", 0),
    ("ceil_mode", False),
    ("count_include_pad", True),
    ("divisor_override", None),
)


def _avg_pool(session: Session, func, args, kwargs) -> Tensor:
    dims = int(func.__name__[-2])
    bound = bind_arguments(args, kwargs, _POOL_SPEC[: 5 if dims == 1 else 6])
    x = bound.pop("input")
    module = getattr(nn, f"AvgPool{dims}d")(**bound)
    return session.apply_rule(module, AvgPoolRule(), x, module)


def _adaptive_avg_pool(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, (("output_size", None),))
    x, size = bound["input"], bound["output_size"]
    dims = int(func.__name__[-2])
    sizes = [size] * dims if isinstance(size, int) else list(size)
    if any(s != 1 for s in sizes):
        raise session.unsupported(
            func.__name__, "Only global pooling (output size 1) is supported; use nn.AvgPool."
        )
    return _mean(session, torch.mean, (x, tuple(range(-dims, 0)), True), {})


_INTERPOLATE_SPEC = (
    ("size", None),
    ("scale_factor", None),
    ("mode", "nearest"),
    ("align_corners", None),
    ("recompute_scale_factor", None),
    ("antialias", False),
)


def _interpolate(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, _INTERPOLATE_SPEC)
    if bound["mode"] in ("nearest", "nearest-exact"):
        return func(*args, **kwargs)
    if bound["antialias"]:
        raise session.unsupported("interpolate", "antialias=True has no module form; use False.")
    module = nn.Upsample(
        bound["size"],
        bound["scale_factor"],
        bound["mode"],
        bound["align_corners"],
        bound["recompute_scale_factor"],
    )
    return session.apply_rule(module, UpsampleRule(), bound["input"], module)


def _dropout(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, (("p", 0.5), ("training", True), ("inplace", False)))
    if bound["training"] and bound["p"] > 0:
        raise session.unsupported(
            func.__name__,
            "Dropout in training mode has a random Jacobian; call model.eval() or pass "
            "training=self.training.",
        )
    return func(*args, **kwargs)


def _scale(session: Session, x: Tensor, c: Tensor | float, compute: Callable[[], Tensor]):
    if isinstance(c, Tensor) and c.requires_grad:
        raise session.unsupported("mul", "Both factors of a product depend on parameters.")
    return _ScaleFunction.apply(x, c.detach() if isinstance(c, Tensor) else c, compute)


def _grad_tensor(t: Any) -> bool:
    return isinstance(t, Tensor) and t.requires_grad


def _mul(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _grad_tensor(a) and _grad_tensor(b):
        if _inplace(func.__name__):
            raise session.unsupported(func.__name__, "Write y = a * b instead of a *= b.")
        return _ProductFunction.apply(a, b, lambda: func(*args, **kwargs))
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write x = x * c instead of scaling in place.")
    if isinstance(a, Tensor) and a.requires_grad:
        x, c = a, b
    else:
        x, c = b, a
    return _scale(session, x, c, lambda: func(*args, **kwargs))


def _div(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _inplace(func.__name__) or kwargs.get("rounding_mode") is not None:
        raise session.unsupported(func.__name__, "Write x = x / c (true division).")
    if isinstance(b, Tensor) and b.requires_grad:
        raise session.unsupported(func.__name__, "The divisor depends on parameters.")
    return _scale(session, a, 1.0 / b, lambda: func(*args, **kwargs))


def _neg(session: Session, func, args, kwargs) -> Tensor:
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write x = -x instead.")
    return _scale(session, args[0], -1.0, lambda: func(*args, **kwargs))


def _sub(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    alpha = kwargs.get("alpha", 1)
    if func.__name__ in ("rsub", "__rsub__"):
        a, b = b, a
    if not (isinstance(b, Tensor) and b.requires_grad) and alpha == 1:
        return func(*args, **kwargs)
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write a = a - b instead of subtracting in place.")
    neg_b = _scale(session, b, -alpha, lambda: b * -alpha)
    return torch.add(neg_b, a)


def _add(session: Session, func, args, kwargs) -> Tensor:
    alpha = kwargs.get("alpha", 1)
    if alpha == 1:
        return func(*args, **kwargs)
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write a = a + alpha * b instead.")
    return torch.add(a, _scale(session, b, alpha, lambda: b * alpha))


def _mean(session: Session, func, args, kwargs) -> Tensor:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    total = x.sum() if dim is None else x.sum(dim, keepdim=keepdim)
    n = x.numel() // max(total.numel(), 1)
    return _scale(session, total, 1.0 / n, lambda: total * (1.0 / n))


_HANDLERS: dict[str, Callable[..., Tensor]] = {
    **dict.fromkeys(_ACTIVATIONS, _activation),
    **dict.fromkeys(("avg_pool1d", "avg_pool2d", "avg_pool3d"), _avg_pool),
    **dict.fromkeys(
        ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"), _adaptive_avg_pool
    ),
    "interpolate": _interpolate,
    **dict.fromkeys(("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"), _dropout),
    **dict.fromkeys(("mul", "multiply", "mul_"), _mul),
    **dict.fromkeys(("div", "divide", "true_divide", "div_"), _div),
    **dict.fromkeys(("neg", "negative", "neg_"), _neg),
    **dict.fromkeys(("sub", "subtract", "rsub", "__rsub__", "sub_"), _sub),
    **dict.fromkeys(("add", "add_"), _add),
    "mean": _mean,
}

# Operations whose Jacobian w.r.t. every input has only 0/1 entries: autograd's backward is the
# DB step. (Negation and subtraction are not: their −1 must become +1, see _sub and _neg.)
_STRUCTURAL = frozenset(
    {
        # joining and splitting
        "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "split",
        "split_with_sizes", "tensor_split", "chunk", "unbind", "narrow", "select",
        # indexing
        "__getitem__", "__setitem__", "index_select", "gather", "take", "take_along_dim",
        "masked_select", "masked_fill", "masked_fill_", "where", "scatter", "scatter_add",
        "index_add", "index_copy", "index_put", "index_put_", "diagonal", "triu", "tril",
        # shapes and copies
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "squeeze",
        "squeeze_", "unsqueeze", "unsqueeze_", "permute", "transpose", "transpose_", "swapaxes",
        "swapdims", "t", "movedim", "moveaxis", "contiguous", "clone", "expand", "expand_as",
        "broadcast_to", "repeat", "tile", "repeat_interleave", "flip", "fliplr", "flipud",
        "roll", "rot90", "pad", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "unfold",
        "fold", "__get__", "copy_", "fill_", "zero_", "to", "type", "float", "double", "half",
        "bfloat16", "cpu", "cuda", "detach", "requires_grad_",
        # sums, selections and 0/1 derivatives
        "add", "add_", "sum", "relu", "relu_", "relu6", "hardtanh", "hardtanh_", "threshold",
        "clamp", "clamp_", "clip", "max", "min", "amax", "amin", "maximum", "minimum", "sort",
        "topk", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
        "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
        "adaptive_max_pool2d", "adaptive_max_pool3d", "interpolate", "max_unpool1d",
        "max_unpool2d", "max_unpool3d", "as_tensor",
    }
)  # fmt: skip

_PASS_THROUGH = _STRUCTURAL - _HANDLERS.keys()
