"""The Monte-Carlo estimator's plan: who serves each parameter, what is verified, what is cached.

:func:`plan` assigns each parameter to its owners (:class:`~lsn_ext.estimators.replay.Owner`:
the leaf modules that hold it, or the smallest enclosing block called on the batch) or to the
whole model. A call verified against the batch weight gradients leaves a :class:`Verified`
record per call structure, so that later calls with the same model state and structure can skip
those gradients; :func:`check_samples_independent` checks once per model state that every
owner's dim 0 is the batch. :class:`RandomOpGuard` refuses train-mode dropout in the forward
pass and counts how often each parameter is used. The caches and why none of them can change a
result are described beside them.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lsn_ext.engine import all_modules, bind_arguments, is_parametrized
from lsn_ext.estimators.replay import Owner


class ReplanError(Exception):
    """Raised inside the forward pass when a leaf's capture cannot serve: plan blocks first."""


class UnverifiedError(Exception):
    """A call without batch weight gradients captured other than the verified call did.

    Other parameters, or the same ones through other module calls (:class:`Verified`). That
    call structure goes back to verified calls for good, or, where the call ended its backward
    pass at the entry modules' outputs (``at_entries``), to passes that end at the input.
    Carries the call's random vectors ``z``, so that the rerun draws nothing new.
    """

    def __init__(self, noise: Tensor, structure: tuple, verified: Verified, at_entries: bool):
        super().__init__()
        self.noise = noise
        self.structure = structure
        self.verified = verified
        self.at_entries = at_entries


@dataclass(frozen=True)
class Verified:
    """What a verified call (batch weight gradients checked) found for one call structure.

    Kept per model, per key of :func:`~lsn_ext.estimators.monte_carlo.monte_carlo` (input
    signature and the model's :func:`~lsn_ext._fingerprint.fingerprint`) and per *structure*
    (the module calls of the forward pass whose output needs a gradient, in order, each with
    whether it was called on the input itself, and how often each parameter entered a torch
    function): a later call uses it only where all three are equal, and checks every draw that
    its backward pass reached exactly ``fired``.

    Attributes:
        captured: The parameters whose per-sample gradients the capture delivered.
        rerouted: Parameters moved to the whole-model path in its first draw.
        fired: The module calls whose output gradient reached the capture in its first draw,
            as ``(owner path, call index)``: every call that contributes to the logits.
        entries: Whether later calls may end their backward pass at the outputs of the modules
            called on the input itself (cleared where that missed a call).
    """

    captured: frozenset[str]
    rerouted: tuple[str, ...]
    fired: frozenset[tuple[str, int]]
    entries: bool = True


# What the Monte-Carlo estimator caches between calls, and why a stale entry cannot change a
# result:
# - _VERIFIED: per model, per (input signature, fingerprint of the model) and per call
#   structure, what a verified call found (Verified; None: verify every call). A later call
#   takes the fast path only where all three are equal to the verified call's, and checks in
#   every draw that its backward pass reached exactly the module calls that call's did: a
#   change of hooks, modes, modules or parameters changes the fingerprint (see
#   lsn_ext._fingerprint), a branch taken on other data changes the structure, and either
#   sends the call down the verified path.
# - _REPLAN: per model, the input signatures whose leaves the capture could not serve, so that
#   the plan probes for blocks before the pass. The probe itself runs on the model as it is
#   now; a stale entry costs one probe, never a result.
# - _INDEPENDENT: per model, the (signature, fingerprint, owners, call structure) whose samples
#   were checked to be independent; any change of those checks again.
# - _LOOP_FASTER (lsn_ext.estimators.per_sample) and the conv rule's _SPLIT_FASTER: which of two
#   exact formulations of the same product is faster for a shape signature. Both compute the
#   same numbers up to round-off, so a stale choice changes the speed only.
_REPLAN: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, dict[tuple, Verified | None]]] = (
    weakref.WeakKeyDictionary()
)
# (model, input shapes and dtypes, state) already checked by check_samples_independent.
_INDEPENDENT: weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]] = weakref.WeakKeyDictionary()
_KEEP = 8
"""Keys per model, and call structures per key, that :data:`_VERIFIED` keeps (most recent)."""


def verified_plans(model: nn.Module, key: tuple) -> dict[tuple, Verified | None]:
    """The verified plans of ``model`` for ``key``, per call structure (most recent kept)."""
    known = _VERIFIED.setdefault(model, {})
    plans = known.pop(key, {})
    keep_recent(known, key, plans)
    return plans


def keep_recent(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value`` as the most recent entry, dropping the oldest beyond :data:`_KEEP`."""
    cache[key] = value
    while len(cache) > _KEEP:
        del cache[next(iter(cache))]


def must_replan(model: nn.Module, signature: tuple) -> bool:
    """Whether the capture could not serve the leaves of ``model`` for ``signature`` before."""
    return signature in _REPLAN.get(model, set())


def remember_replan(model: nn.Module, signature: tuple) -> None:
    """From now on, probe ``model`` for blocks before the pass for ``signature``."""
    _REPLAN.setdefault(model, set()).add(signature)


class RandomOpGuard(TorchFunctionMode):
    """Refuses train-mode functional dropout in ``forward`` (a random Jacobian), as DB does.

    With ``count_uses``, also counts how often each parameter enters a torch function in the
    forward pass (``uses``, by ``id``, in order of first use): a module whose ``forward`` is
    called directly (no hooks fire) or a parameter used outside its module's call changes these
    counts where the hooked module calls stay the same.
    """

    def __init__(self, model: nn.Module, count_uses: bool = False):
        super().__init__()
        self.model = model
        self.uses: Counter[int] | None = Counter() if count_uses else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.uses is not None:
            for a in args:
                if isinstance(a, nn.Parameter):
                    self.uses[id(a)] += 1
            for a in kwargs.values():
                if isinstance(a, nn.Parameter):
                    self.uses[id(a)] += 1
        name = getattr(func, "__name__", None)
        if name in _DROPOUT and torch.is_grad_enabled():
            bound = bind_arguments(
                args, kwargs, (("p", 0.5), ("training", True), ("inplace", False))
            )
            if bound["training"] and bound["p"] > 0:
                module = _current_module(self.model)
                where = "the model" if module is None else f"{describe_module(self.model, module)}"
                raise NotImplementedError(
                    f"the Monte-Carlo estimator cannot run '{name}' with training=True and "
                    f"p={bound['p']} in the forward of {where}: dropout in training mode has a "
                    "random Jacobian, so the GGN of one forward pass is not the model's. Call "
                    "model.eval() or pass training=self.training"
                )
        return func(*args, **kwargs)


_DROPOUT = frozenset(
    {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
)


def _current_module(model: nn.Module) -> nn.Module | None:
    """The innermost module of ``model`` whose code is running (walks the Python frames)."""
    ids = {id(m) for m in model.modules()}
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in ids:
            return owner
        frame = frame.f_back
    return None


def describe_module(model: nn.Module, module: nn.Module) -> str:
    """``'path' (Class)`` of ``module`` inside ``model``, for error messages."""
    return f"'{module_path(model, module)}' ({type(module).__name__})"


def check_samples_independent(
    model: nn.Module, owners: list[Owner], args: tuple, whole: bool = False, state: tuple = ()
) -> None:
    """Verify once per model and state that dim 0 of every owner's input is the batch.

    ``state`` is what else the answer depends on (the Monte-Carlo pass passes the model's
    fingerprint and the call structure: a mode switch, a swapped module or another branch
    checks again).

    Per-sample gradients split each owning module's input along dim 0. A module whose input
    has the batch's size in dim 0 without it being the batch (a sequence-first ``[L, N, E]``
    tensor with ``L = N``) would be split wrongly, and the sums the per-draw check compares
    still agree: a silently biased estimate. Here one forward and one backward pass (no
    forward-mode AD needed) measure whether any row ``j ≠ 0`` of an owner's input depends on
    sample 0 of the model's inputs; if so the module is named. A block (replayed whole) and,
    with ``whole``, the model itself are also checked at their outputs: a block that mixes the
    samples inside would otherwise pass.

    Raises:
        NotImplementedError: Naming the module whose dim 0 mixes samples.
    """
    tensors = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
    batch = tensors[0].shape[0] if tensors else 0
    if batch < 2 or not (owners or whole):
        return
    key = (
        tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, Tensor)),
        tuple((o.path, o.block) for o in owners),
        whole,
        state,
    )
    done = _INDEPENDENT.setdefault(model, {})
    if key in done:
        return
    leaves = [
        a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point()
        else a
        for a in args
    ]  # fmt: skip
    seen: list[tuple[str, str, Tensor]] = []  # (who, "input"/"output", tensor)

    def record(owner: Owner):
        def hook(module: nn.Module, hook_args: tuple) -> None:
            if hook_args and isinstance(hook_args[0], Tensor) and hook_args[0].requires_grad:
                seen.append((owner.describe(), "input", hook_args[0]))

        return hook

    def record_output(owner: Owner):
        def hook(module: nn.Module, hook_args: tuple, out: Any) -> None:
            if isinstance(out, Tensor) and out.requires_grad:
                seen.append((f"the block {owner.describe()}", "output", out))

        return hook

    handles = [o.module.register_forward_pre_hook(record(o)) for o in owners]
    handles += [
        o.module.register_forward_hook(record_output(o), prepend=True) for o in owners if o.block
    ]
    try:
        with torch.enable_grad(), RandomOpGuard(model):
            out = model(*leaves)
    finally:
        for handle in handles:
            handle.remove()
    if whole and isinstance(out, Tensor) and out.requires_grad:
        seen.append(("the model", "output", out))
    inputs = [a for a in leaves if isinstance(a, Tensor) and a.requires_grad]
    generator = torch.Generator(device=inputs[0].device).manual_seed(0)

    def leak(pairs: list[tuple[str, str, Tensor]]) -> bool:
        terms = [
            (x[1:] * torch.randn(x[1:].shape, generator=generator, dtype=x.dtype, device=x.device))
            .sum()
            for _, _, x in pairs
            if x.dim() > 0 and x.shape[0] == batch
        ]  # fmt: skip
        if not terms:
            return False
        grads = torch.autograd.grad(sum(terms), inputs, allow_unused=True, retain_graph=True)
        return any(g is not None and bool((g[0] != 0).any()) for g in grads)

    if leak(seen):
        who, kind, _ = next(s for s in seen if leak([s]))
        if kind == "input":
            raise NotImplementedError(
                f"{who} gets inputs whose dim 0 has the batch's size ({batch}) but "
                "mixes the samples: other rows of it depend on sample 0 (a sequence-first "
                "[L, N, E] tensor with L = N?). The Monte-Carlo estimator splits a module's "
                "input along dim 0 into samples: give the module batch-first inputs (e.g. "
                "nn.MultiheadAttention(..., batch_first=True)), or use estimator='db' where it "
                "has rules"
            )
        raise NotImplementedError(
            f"{who} mixes the samples: other rows of its output depend on sample 0 of the "
            "input (batch statistics, training-mode normalisation, attention across dim 0?). "
            "The Monte-Carlo estimator replays it per sample (per-module capture cannot serve "
            "its parameters), which needs a forward that treats the samples independently; "
            "call model.eval(), or use estimator='db' where it has rules"
        )
    keep_recent(done, key, True)


def module_path(model: nn.Module, module: nn.Module) -> str:
    """The path of ``module`` in ``model`` (``<model>`` for the model itself, ``?`` if absent)."""
    return next((n or "<model>" for n, m in model.named_modules() if m is module), "?")


def _probe(model: nn.Module, args: tuple) -> dict[int, bool]:
    """Per module: whether every call takes one tensor whose dim 0 is the batch (no grad pass)."""
    batch = args[0].shape[0] if args and isinstance(args[0], Tensor) else None
    ok: dict[int, bool] = {}

    def hook(module: nn.Module, hargs: tuple, kwargs: dict, out: Any) -> None:
        x = hargs[0] if len(hargs) == 1 and not kwargs else None
        fine = (
            isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch
            and isinstance(out, Tensor) and out.dim() > 0 and out.shape[0] == batch
        )  # fmt: skip
        ok[id(module)] = ok.get(id(module), True) and fine

    handles = [
        m.register_forward_hook(hook, with_kwargs=True)
        for m in all_modules(model)
        if m is not model
    ]
    try:
        with torch.no_grad(), RandomOpGuard(model):
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return ok


def plan(
    model: nn.Module,
    names: list[str],
    chosen: list[Tensor],
    args: tuple,
    replan: bool,
    force: str | None,
) -> tuple[list[Owner], list[str]]:
    """Owners (leaf modules and blocks) and the parameters served by the whole model.

    A parameter tied across modules (``b.weight = a.weight``) has several owners; their
    per-sample gradients are summed before squaring
    (:func:`~lsn_ext.estimators.capture.gather`). Without ``replan``, and when every owner is a
    leaf without parametrizations, all owners are leaves and nothing is probed (the capture
    raises :class:`ReplanError` if a leaf turns out to be called on folded or several inputs).
    Otherwise one forward pass without grad finds which modules are called with one tensor
    whose dim 0 is the batch, and each parameter goes to its leaf if that can serve, else to
    the smallest such enclosing module (a block), else to the whole model.
    """
    wanted = {id(p): n for n, p in zip(names, chosen, strict=True)}
    if force == "model":
        return [], list(names)
    held = []  # (path, module, {own name: model name})
    for path, module in model.named_modules():
        own = {n: wanted[id(p)] for n, p in module._parameters.items() if id(p) in wanted}
        if own:
            held.append((path, module, own))
    simple = all(not m._modules and not is_parametrized(m) for _, m, _ in held)
    if simple and not replan:
        return [Owner(m, path or "<model>", own) for path, m, own in held], []
    feasible = _probe(model, args)
    by_path = dict(model.named_modules())

    # Modules inside a parametrization (weight_norm's _WeightNorm, …) are not blocks.
    inside = {
        id(m)
        for pm in model.modules()
        if is_parametrized(pm)
        for m in pm.parametrizations.modules()
    }

    def home(path: str, module: nn.Module) -> str | None:
        """``path`` itself for a serviceable leaf, an enclosing block's path, or None (model)."""
        odd = bool(module._modules) or is_parametrized(module) or id(module) in inside
        if module is not model and not odd and feasible.get(id(module), True):
            return path
        p = path if module._modules else _parent(path)
        while p:
            m = by_path[p]
            if feasible.get(id(m)) is True and id(m) not in inside:
                return p
            p = _parent(p)
        return None

    leaves: list[tuple[str, nn.Module, dict[str, str]]] = []
    blocks: set[str] = set()
    whole: set[str] = set()
    for path, module, own in held:
        h = home(path, module)
        if h is None:
            whole.update(own.values())
        elif h == path and not module._modules:
            leaves.append((path, module, own))
        else:
            blocks.add(h)
    blocks = {b for b in blocks if not any(b.startswith(o + ".") for o in blocks)}
    owners = []
    for b in sorted(blocks):
        module = by_path[b]
        own = {}
        for rel, p in module.named_parameters():
            if id(p) in wanted and wanted[id(p)] not in whole:
                own[rel] = wanted[id(p)]
        owners.append(Owner(module, b, own, block=True))
    for path, module, own in leaves:
        if any(path.startswith(b + ".") for b in blocks):
            continue
        own = {k: n for k, n in own.items() if n not in whole}
        if own:
            owners.append(Owner(module, path or "<model>", own))
    for owner in owners:
        owner.names = {k: n for k, n in owner.names.items() if n not in whole}
    return [o for o in owners if o.names], [n for n in names if n in whole]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]
