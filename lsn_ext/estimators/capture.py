"""The capture of the Monte-Carlo estimator: per-sample gradients from hooks on the owners' calls.

:class:`Capture` runs the forward pass with a forward hook on every owning module
(:class:`~lsn_ext.estimators.replay.Owner`): each call taps its output with a tensor hook that
receives ``g``, the gradient at the output in each draw's backward pass, and hands the
module's input and ``g`` to the owner. :func:`gather` and :func:`gather_squares` collect one
draw's per-sample gradients (or their squares) per parameter and check them against the batch
gradients; :func:`raise_lost` reports a capture that stopped serving after the first draw.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lsn_ext.engine import ModeAside, all_modules, round_off, sum_tolerance
from lsn_ext.estimators.planner import RandomOpGuard, ReplanError, describe_module, module_path
from lsn_ext.estimators.replay import Owner
from lsn_ext.rules import RULES, Rule


class Capture:
    """The hooks of one Monte-Carlo pass on the owners' calls, and what they record.

    The forward pass (:meth:`forward`) records its call structure (the owners' calls whose
    output needs a gradient, each with whether it was called on the input itself, and the
    parameters' use counts of :class:`~lsn_ext.estimators.planner.RandomOpGuard`). In every
    draw's backward pass, the tensor hooks on the tapped outputs hand each call's input and
    output gradient to its owner, and record which calls fired.

    Attributes:
        model: The network.
        owners: The modules whose calls are tapped.
        batch: The batch size (dim 0 of the first input).
        inputs: The model inputs that carry a gradient (on a call that may skip the weights'
            gradients).
        fast: Whether this call may skip the weights' gradients (a later call): then the
            guard counts the parameters' uses, and the outputs of modules called on an input
            are kept as ``entries``.
        guard: The forward pass's :class:`~lsn_ext.estimators.planner.RandomOpGuard`.
        taps: The tensor hooks, removed after the backward passes (:meth:`release`).
        fired: ``(owner path, call index)`` of the calls whose gradient arrived in this draw.
        calls: The structure: ``(owner path, call index, entry)`` per tapped call.
        entries: Outputs of module calls on an input, with their versions.
    """

    def __init__(
        self, model: nn.Module, owners: list[Owner], args: tuple, inputs: list[Tensor], fast: bool
    ):
        self.model, self.owners, self.inputs, self.fast = model, owners, inputs, fast
        self.batch = args[0].shape[0] if args and isinstance(args[0], Tensor) else None
        self.guard = RandomOpGuard(model, count_uses=fast)
        self.taps: list[Any] = []
        self.fired: set[tuple[str, int]] = set()
        self.calls: list[tuple[str, int, bool]] = []
        self.entries: list[tuple[Tensor, int]] = []

    def forward(self, args: tuple) -> Tensor:
        """The model's output on ``args``, with the rules' checks and the owners' calls tapped."""
        handles: list[Any] = []
        try:
            for module in all_modules(self.model):
                rule = RULES.get(type(module))
                if rule is not None and type(rule).check is not Rule.check:
                    handles.append(module.register_forward_pre_hook(self._check))
            for owner in self.owners:
                # First among the module's forward hooks: a hook of the user's that changes the
                # output acts after the capture, like any later operation.
                hook = self._capture(owner)
                handles.append(
                    owner.module.register_forward_hook(hook, with_kwargs=True, prepend=True)
                )
            with torch.enable_grad(), self.guard:
                return self.model(*args)
        finally:
            for handle in handles:
                handle.remove()

    def structure(self) -> tuple:
        """The call structure of the forward pass (see :class:`Capture`)."""
        return (tuple(self.calls), tuple(self.guard.uses.items()) if self.fast else ())

    def release(self) -> None:
        """Remove the tensor hooks and what the owners hold of this pass.

        The hooks hold the module inputs; removing them lets the graph go with the call.
        """
        for tap in self.taps:
            tap.remove()
        self.entries.clear()
        for owner in self.owners:
            owner.partial = owner.squares = None

    def _check(self, module: nn.Module, _args: Any) -> None:
        try:
            RULES[type(module)].check(module)
        except ValueError as err:
            where = module_path(self.model, module)
            raise ValueError(f"'{where}' ({type(module).__name__}): {err}") from None

    def _capture(self, owner: Owner):
        """The forward hook that taps the calls of ``owner``."""
        fast, inputs, entries = self.fast, self.inputs, self.entries
        calls, fired, taps = self.calls, self.fired, self.taps

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            with ModeAside(self.guard):  # the capture's own code: nothing for the guard to inspect
                return tap(module, args, kwargs, out)

        def tap(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            x = args[0] if len(args) == 1 and isinstance(args[0], Tensor) else None
            if kwargs or x is None:
                if not owner.block:
                    raise ReplanError
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) was called with {len(args)} "
                    f"positional and {len(kwargs)} keyword arguments; the Monte-Carlo estimator "
                    "takes per-sample gradients of modules with one tensor input"
                )
            x = x.detach()
            if not isinstance(out, Tensor) or x.dim() == 0 or x.shape[0] != self.batch:
                if not owner.block:
                    raise ReplanError
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) gets an input of shape "
                    f"{tuple(x.shape)} whose first dimension is not the batch "
                    f"({self.batch}): per-sample gradients need the samples along dim 0"
                )
            if not out.requires_grad:
                return None
            tapped = out.clone() if out._is_view() else out
            entry = fast and any(args[0] is t for t in inputs)
            if entry:
                entries.append((tapped, tapped._version))
            call = (owner.path, owner.calls)
            calls.append((*call, entry))
            owner.calls += 1
            # The batched output, for the replays to reproduce (a leaf's only while unchanged:
            # an in-place operation after the module, ReLU(inplace=True), changes it); none is
            # kept where no replay can happen (Owner.may_replay).
            y = out.detach() if owner.may_replay else None
            version = None if y is None else y._version

            def arrived(g: Tensor) -> None:
                fired.add(call)
                if owner.alone and owner.calls == 1:
                    owner.squares = owner.sample_squares(x, g, _unchanged(y, version))
                elif owner.block:
                    owner.add(owner.block_grads(x, g, y))
                else:
                    owner.add(owner.sample_grads(x, g, _unchanged(y, version)))

            taps.append(tapped.register_hook(arrived))
            return tapped if tapped is not out else None

        return hook


def _unchanged(t: Tensor | None, version: int | None) -> Tensor | None:
    """``t`` where no in-place operation changed it since its version was ``version``."""
    return t if t is not None and t._version == version else None


def gather(
    owners: list[Owner], total_grads: dict[str, Tensor | None]
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """One draw's per-sample gradients per parameter, and the parameters that were lost.

    The per-sample gradients of a parameter are summed over all its owners (a weight tied
    across modules) and all their calls: ``Σ_modules J_nᵀ s_n``. ``total_grads`` maps the
    model's parameter names to ``Σ_n J_nᵀ s_n`` from one ordinary backward pass. A parameter
    that autograd reaches must have been captured, and its per-sample gradients must sum to
    autograd's (to round-off relative to the larger of their magnitude): a capture that did not
    fire, or fired for some of the module's calls only, would otherwise give a silently wrong,
    too small estimate. Round-off in a tensor whose gradient is structurally zero is relative
    to the largest gradient entry of the model in this draw; a tensor whose gradients are all
    below ``√eps`` of that entry is not checked (its squares are below ``eps`` of the draw's
    largest, and rounding can be amplified there).

    Returns:
        ``(per_sample, lost)``: ``{name: [N, *shape]}``, and ``{name: what went wrong}``.
    """
    floor = max((float(g.abs().max()) for g in total_grads.values() if g is not None), default=0.0)
    per_sample: dict[str, Tensor] = {}
    where: dict[str, list[Owner]] = {}
    for owner in owners:
        for own, name in owner.names.items():
            where.setdefault(name, []).append(owner)
            if owner.partial is not None:
                g = owner.partial[own]
                per_sample[name] = per_sample[name] + g if name in per_sample else g
        owner.partial = None
    lost: dict[str, str] = {}
    for name, expected in total_grads.items():
        if expected is None or name not in where:
            continue
        got = per_sample.get(name)
        if got is None:
            lost[name] = "none arrived"
            continue
        scale = max(float(got.abs().sum(0).max()), float(expected.abs().max()))
        err = float((got.sum(0) - expected).abs().max())
        eps = round_off(expected)
        if scale <= math.sqrt(eps) * floor:
            # Gradients at round-off level, e.g. zero in exact arithmetic but amplified noise
            # (GroupNorm over one value per group: x̂ = 0 up to rounding / √eps_gn). Whatever
            # the capture did, their squares are below eps of the draw's largest: no check.
            continue
        tol = sum_tolerance(eps)
        if not err <= max(tol, 1e-9) * scale + tol * floor:
            lost[name] = f"they sum to a different gradient ({err:.3g} off at {scale:.3g})"
    return per_sample, lost


def gather_squares(owners: list[Owner]) -> dict[str, Tensor]:
    """One draw's ``Σ_n (J_nᵀ s_n)²`` from the owners that squared their own share."""
    squares: dict[str, Tensor] = {}
    for owner in owners:
        if owner.squares is not None:
            squares.update({name: owner.squares[own] for own, name in owner.names.items()})
        owner.squares = None
    return squares


def raise_lost(model: nn.Module, name: str, owners: list[Owner], what: str) -> None:
    """Raise a ``RuntimeError``: the capture of ``name`` stopped serving after the first draw."""
    modules = " and ".join(o.describe() for o in owners if name in o.names.values())
    raise RuntimeError(
        f"the Monte-Carlo estimator lost the per-sample gradients of '{name}' in "
        f"{modules or describe_module(model, model)}: {what}, although the parameter reaches the "
        "output and its capture worked in the first draw. Something after the module bypasses "
        "the output it returned (an in-place operation on it?). Write that operation out of "
        "place, or use estimator='db'"
    )
