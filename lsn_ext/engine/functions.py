"""The autograd Functions of a DB pass: one node per rule call, constant scaling, products.

:class:`RuleFunction` runs a layer in forward and its rule in backward (or, in a forward-mode
session, the rule's squared forward step in ``jvp``); :class:`ScaleFunction` and
:class:`ProductFunction` do the same for ``c · x`` and ``a ⊙ b`` in ``forward``. A rule node
reaches what it needs through its :class:`Call`, which holds no reference to the session.
:func:`is_foreign_function` tells a node of any other custom Function (which DB cannot
propagate through) from these and torch's identities.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lsn_ext.rules import Rule
from lsn_ext.rules.elementwise import scale_forward_rule, scale_rule
from lsn_ext.rules.product import product_forward_rule, product_rule

__all__ = [
    "Blocks",
    "Call",
    "Flags",
    "ProductFunction",
    "RuleFunction",
    "ScaleFunction",
    "is_foreign_function",
]


class Blocks:
    """The loss Hessian's block for the head calls of one DB pass (see ``Session.head_indices``).

    Rule nodes reach it through their :class:`Call`; it holds no reference to the session or
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
class Call:
    """One application of a rule in the forward pass.

    Deliberately without a reference to the session (see :class:`Blocks`).
    """

    forward_mode: bool
    blocks: Blocks
    module: nn.Module
    rule: Rule
    run: Callable[[Tensor], Tensor]
    index: int
    param_names: tuple[str, ...]
    flags: Flags


@dataclass(frozen=True)
class Flags:
    """What a rule node keeps for backward: the input, the output; whether the layer is in place."""

    keep_x: bool
    keep_y: bool
    inplace: bool

    @classmethod
    def of(cls, module: nn.Module, rule: Rule) -> Flags:
        """The flags of ``module`` under ``rule``."""
        # Not getattr(module, "inplace", False) alone: a module without the attribute raises
        # (and formats) an AttributeError in nn.Module.__getattr__, on every module and call.
        has = "inplace" in module.__dict__ or hasattr(type(module), "inplace")
        inplace = has and bool(module.inplace)
        return cls(rule.reads_input(module), rule.reads_output(module), inplace)


class RuleFunction(torch.autograd.Function):
    """Runs a layer in forward and its DB rule in backward; params are inputs 2, 3, and so on.

    In a forward-mode session (:func:`lsn_ext.forward.linearized_variance`) the tangents are
    variances and :meth:`jvp` applies the rule's squared forward step instead.
    """

    @staticmethod
    def forward(ctx, call: Call, x: Tensor, *params: Tensor):
        """``y = call.run(x)``, keeping what the rule reads in backward (or ``jvp``)."""
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
        call: Call = ctx.call
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
        """``m_in`` and the parameters' DB diagonals from the rule, for ``m`` w.r.t. ``y``.

        A head call of the cross-entropy's exact first step starts from the loss Hessian's
        block instead (:meth:`Blocks.take`).
        """
        call: Call = ctx.call
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


class ScaleFunction(torch.autograd.Function):
    """``y = compute()`` with ``y = c · x``; backward is :func:`scale_rule`."""

    @staticmethod
    def forward(ctx, x: Tensor, c: Tensor | float, compute: Callable[[], Tensor]):
        """``y = compute()``, keeping ``c`` and the shape of ``x``."""
        ctx.c, ctx.shape = c, x.shape
        return compute()

    @staticmethod
    def backward(ctx, m_out: Tensor):
        """``m_x = Σ_broadcast c² · m_out`` (:func:`scale_rule`)."""
        return scale_rule(m_out, ctx.c, ctx.shape), None, None

    @staticmethod
    def jvp(ctx, v_in: Tensor, _c_tangent: None, _compute_tangent: None):
        """Forward-mode session: ``v_out = c² · v_in`` (:func:`scale_forward_rule`)."""
        c = ctx.c
        shape = torch.broadcast_shapes(ctx.shape, c.shape if isinstance(c, Tensor) else ())
        with torch.no_grad():
            return scale_forward_rule(v_in, c, shape)


class ProductFunction(torch.autograd.Function):
    """``y = compute()`` with ``y = a ⊙ b``, both factors in the graph.

    Backward is :func:`~lsn_ext.rules.product.product_rule`.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, compute: Callable[[], Tensor]):
        """``y = compute()``, keeping both factors."""
        ctx.save_for_backward(a, b)
        ctx.save_for_forward(a, b)
        ctx.set_materialize_grads(False)  # absent tangents (zero variance) arrive as None
        return compute()

    @staticmethod
    def backward(ctx, m_out: Tensor | None):
        """``(m_a, m_b) = (Σ b² m_out, Σ a² m_out)``, each summed to its factor's shape."""
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


def _identity_functions() -> tuple[type, ...]:
    """The identity Functions of torch itself, inserted by full backward hooks (BackPACK)."""
    from torch.nn.modules import _functions

    hook = getattr(_functions, "BackwardHookFunction", None)
    return (hook,) if hook is not None else ()


def is_foreign_function(node: Any) -> bool:
    """Whether a graph node is a ``torch.autograd.Function`` that DB cannot propagate through.

    That is any custom Function but this module's rule nodes and torch's identities.
    """
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    return node._forward_cls not in _known_functions()


@functools.cache
def _known_functions() -> tuple[type, ...]:
    """This module's rule nodes and torch's identities (see :func:`is_foreign_function`)."""
    return (RuleFunction, ScaleFunction, ProductFunction, *_identity_functions())
