"""The session of one DB pass: what it installs on the model, and what it sees in ``forward``.

:class:`Session` is a ``TorchFunctionMode`` that, for the duration of one forward pass,

- replaces the ``forward`` of every module whose rule is not exact under autograd by one that
  runs the module as a rule node (:class:`~lsn_ext.engine.functions.RuleFunction`), installs
  the pre-hooks that check a module's mode and refuse parametric modules without a rule, and
  removes all of it on exit;
- routes every other operation in ``forward`` that touches the graph through the table of
  :mod:`lsn_ext.engine.handlers`, and refuses the rest naming the operation and the module;
- after the pass, refuses custom ``torch.autograd.Function`` nodes in the graph and finds the
  head calls that take the cross-entropy's exact first step.

:class:`ModeAside`, :func:`all_modules` and :func:`is_parametrized` are shared with the
Monte-Carlo estimator.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any

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

from lsn_ext.engine.functions import Blocks, Call, Flags, RuleFunction, is_foreign_function
from lsn_ext.engine.handlers import STRUCTURAL, handler_table, needs_grad
from lsn_ext.rules import RULES, Rule, get_rule, register_adapters_for

__all__ = ["ModeAside", "Session", "all_modules", "is_parametrized"]


class Session(TorchFunctionMode):
    """State of one DB forward pass: installs and removes everything on ``model``."""

    def __init__(self, model: nn.Module, *, forward_mode: bool = False):
        super().__init__()
        self.model = model
        # True for the forward (linearised variance) pass: rule nodes save what jvp needs.
        self.forward_mode = forward_mode
        self._paths: dict[int, str] | None = None
        self.counter = itertools.count()
        self.blocks = Blocks()
        self._handles: list[Any] = []
        self._patched: list[tuple[nn.Module, Any]] = []
        # The functional handlers of this pass (the rules' functional forms as registered when
        # it starts), the structural operations without one, and the forms' names.
        self._handlers: dict[str, Callable[..., Tensor]] = {}
        self._pass_through: frozenset[str] = frozenset()
        self._functional: tuple[str, ...] = ()

    # -- installation --------------------------------------------------------------------------

    def __enter__(self):
        try:
            modules = all_modules(self.model)
            register_adapters_for(modules)
            self._handlers, self._functional = handler_table()
            self._pass_through = STRUCTURAL - self._handlers.keys()
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
        flags = Flags.of(module, rule)

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
            if is_foreign_function(node):
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
                if not found and is_foreign_function(node) and node._forward_cls is cls:
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
        flags: Flags | None = None,
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
        call = Call(
            self.forward_mode,
            self.blocks,
            module,
            rule,
            run,
            next(self.counter),
            param_names,
            flags or Flags.of(module, rule),
        )
        return RuleFunction.apply(call, x, *params)

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
            if isinstance(call, Call) and call.rule.has_block_rule():
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
        if not isinstance(call, Call):
            return type(node).__name__
        if self.path(call.module) != "?":
            return self.describe(call.module)
        return f"a functional {type(call.module).__name__.lower()} in forward"

    # -- functional operations ------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if not torch.is_grad_enabled() or name in self._pass_through:
            return func(*args, **kwargs)
        handler = self._handlers.get(name)
        if handler is not None and needs_grad((args, kwargs)):
            return handler(self, func, args, kwargs)
        out = func(*args, **kwargs)
        if name not in STRUCTURAL and needs_grad(out):
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
            f"the functional activations {list(self._functional)}, F.avg_pool*d and "
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
