"""The Monte-Carlo GGN diagonal: the passes of one call, their checks and the estimate.

:func:`monte_carlo` plans who serves each parameter (:mod:`~lsn_ext.estimators.planner`), runs
one forward pass with the owners' calls tapped (:mod:`~lsn_ext.estimators.capture`), draws the
vectors ``s = B z`` and takes one backward pass per draw, squaring the per-sample gradients
(:mod:`~lsn_ext.estimators.per_sample`, :mod:`~lsn_ext.estimators.replay`), and repeats the
call with another plan where the capture cannot serve. The estimator's maths and its paths are
described in :mod:`lsn_ext.estimators`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from lsn_ext._fingerprint import fingerprint, global_forward_hooks
from lsn_ext._memory import check_sample_memory
from lsn_ext.engine import (
    DiagBackpropResult,
    all_modules,
    check_finite_logits,
    check_finite_result,
    check_inputs,
    check_logits,
    select_params,
)
from lsn_ext.estimators.capture import Capture, gather, gather_squares, raise_lost
from lsn_ext.estimators.per_sample import square_sum
from lsn_ext.estimators.planner import (
    ReplanError,
    UnverifiedError,
    Verified,
    check_samples_independent,
    keep_recent,
    must_replan,
    plan,
    remember_replan,
    verified_plans,
)
from lsn_ext.estimators.replay import BY_MODEL, BY_MODULE, Owner, whole_model
from lsn_ext.rules import register_adapters_for
from lsn_ext.rules.losses import Loss


def monte_carlo(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss_fn: Loss,
    mc_samples: int,
    generator: torch.Generator | None,
    params: Sequence[Tensor] | None,
    noise: Tensor | None = None,
    _force: Literal["model"] | None = None,
) -> DiagBackpropResult:
    """The Monte-Carlo GGN diagonal (see the module documentation).

    ``noise`` (``[S, *logits.shape]``) replaces the Rademacher vectors ``z``, for tests.
    ``_force="model"`` takes every parameter's per-sample gradients through the whole model
    (for tests of that path).

    Each call of an owning module taps its output with a tensor hook that receives ``g``, the
    gradient at the output. A view (InstanceNorm returns one) loses its hooks when an in-place
    operation follows (``LeakyReLU(inplace=True)``), so such an output is replaced by a copy
    that carries the hook. Every draw is checked: the per-sample gradients of each parameter
    must sum to the gradient of an ordinary backward pass.

    Where that capture cannot serve a parameter, its per-sample gradients come from a larger
    replay, in this order of preference (``mc_paths`` of the result says which, per parameter):

    1. ``"module"``: the leaf module that holds it (the default, cheapest path);
    2. ``"block '<path>'"``: the smallest enclosing module that is called with one tensor
       whose dim 0 is the batch, replayed whole per sample (parameters of modules with
       submodules, e.g. MONAI UNETR's position embeddings; parametrizations such as
       ``weight_norm``; leaves called on folded or several inputs, e.g. SwinUNETR's window
       attention, which folds the windows into dim 0);
    3. ``"model"``: the whole model, per sample with ``torch.func`` (``vmap`` over the batch of
       ``vjp`` of ``functional_call``, the vectors ``s = B z`` as output cotangents, chunked),
       where no such block exists, and for a parameter whose capture failed in the first draw
       (used outside its module's call, or bypassed by an in-place operation).

    All three give the same per-sample gradients ``J_nᵀ s_n``, so the estimate and its
    expectation are the same; only the cost differs (a block or the model costs about one
    more forward and backward pass of it). The replays check that each sample's output equals
    the batched forward's, and the one-off independence check covers their outputs.

    Cost: the check that per-sample gradients sum to the batch gradients needs the batch weight
    gradients, a second set of weight products beside the per-sample ones. It runs on the first
    call per model, input signature, model state and call structure (every draw): the state is
    the model's :func:`~lsn_ext._fingerprint.fingerprint` (each module's identity, class,
    training flag and hooks, the parameter tensors it holds, torch's global hooks), read every
    call; the structure is the sequence of owner calls in this forward pass and how often each
    parameter entered a torch function (a data-dependent branch that calls other modules, or a
    module's ``forward`` directly, has another). Where any of them differs from every verified
    call's, the call is verified again; with torch's global forward hooks registered (they run
    before the capture's and may change any output) every call is. Later calls with the same
    key take the backward pass only as far as the capture needs (no batch weight gradients)
    and check in every draw that it delivers exactly the parameters the verified call did,
    from the same module calls (a call whose output does not depend on the input, e.g. a shared
    module applied to a buffer as well, is out of the pass's reach), else that structure falls
    back to verified calls for good. The capture's hook is the first forward hook of each
    module, so a user's hook that changes the output acts after it. The pass ends at the outputs
    of the modules called on the input itself (the *entries*: the first convolution of a
    U-Net), which skips their input gradient (a 3-channel input at 64², batch 8: 0.55 ms of a
    25 ms training step); at the input where an in-place operation changes an entry's output
    later (``ReLU(inplace=True)``: autograd's pass to that output would stop short of its hook),
    and for good where ending at the entries missed a module call (the input also reaches a
    module through other operations). Autograd holds the requested gradients until the
    call returns, so only the entries' are requested, not every tapped output's (that cost
    +10 MiB, 1.43× → 1.54× a training step's peak, on the paper's U-Net at 128², batch 8).
    Inputs that cannot carry a gradient (integer tensors) keep every call verified.
    """
    named_params = list(model.named_parameters())
    names, chosen = select_params(model, params, named_params)
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    check_inputs(model, args, named_params)
    modules = all_modules(model)
    register_adapters_for(modules)
    signature = _signature(args, names)
    state = fingerprint(modules)
    replan = _force is not None or must_replan(model, signature)
    # Global forward hooks run before the capture's and may change any output on any call.
    fast = _force is None and not global_forward_hooks()
    plans = verified_plans(model, (signature, state)) if fast else None
    while True:
        owners, whole = plan(model, names, chosen, args, replan, _force)
        try:
            result, structure, found = _run(
                model, args, targets, loss_fn, mc_samples, generator, noise, names, chosen,
                owners, whole, plans, state,
            )  # fmt: skip
        except ReplanError:
            if replan:
                raise
            remember_replan(model, signature)
            if plans is not None:
                plans.clear()
            replan = True
            continue
        except RuntimeError as err:
            explained = _explained(err)
            if explained is None:
                raise
            raise explained from err
        except UnverifiedError as err:
            # Verified calls from now on, or passes to the input where the entries missed one.
            plans[err.structure] = (
                dataclasses.replace(err.verified, entries=False) if err.at_entries else None
            )
            noise = err.noise
            continue
        if plans is not None and found is not None and structure not in plans:
            keep_recent(plans, structure, found)
        return result


def _explained(err: RuntimeError) -> NotImplementedError | None:
    """A torch error of the passes, told as what it means for the estimator (None: as it is)."""
    text = str(err)
    if "use_reentrant=True" in text:
        return NotImplementedError(
            "the model uses torch.utils.checkpoint with use_reentrant=True, whose backward "
            "pass cannot run under torch.autograd.grad, and the Monte-Carlo estimator takes "
            "its backward passes that way (to the capture's tensors, not into .grad). Pass "
            "use_reentrant=False to torch.utils.checkpoint.checkpoint (torch's recommended "
            "variant; the estimator supports it), or switch checkpointing off for the "
            "curvature (it changes memory, not the function)"
        )
    if "donated buffers" in text:
        return NotImplementedError(
            "the model (or a submodule) is compiled with torch.compile, whose compiled "
            "backward frees its saved tensors after one pass (donated buffers), and the "
            "Monte-Carlo estimator takes several backward passes of one forward pass (one per "
            "draw, and its checks). Pass the uncompiled module (model._orig_mod of a "
            "torch.compile'd model: the same parameters), or set "
            "torch._functorch.config.donated_buffer = False before compiling"
        )
    return None


def _signature(args: tuple, names: list[str]) -> tuple:
    shapes = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, Tensor))
    return shapes, tuple(names)


def _run(
    model: nn.Module,
    args: tuple,
    targets: Tensor,
    loss_fn: Loss,
    mc_samples: int,
    generator: torch.Generator | None,
    noise: Tensor | None,
    names: list[str],
    chosen: list[Tensor],
    owners: list[Owner],
    whole: list[str],
    plans: dict[tuple, Verified | None] | None = None,
    model_state: tuple = (),
) -> tuple[DiagBackpropResult, tuple, Verified | None]:
    """One Monte-Carlo pass with a given plan (see :func:`monte_carlo`).

    ``plans`` holds what earlier verified calls found for this model, signature and
    fingerprint (``model_state``), per call structure; ``None``: verify this call. The forward
    pass records its call structure (the owners' calls whose output needs a gradient, each
    with whether it was called on the input, and the parameters' use counts of
    :class:`~lsn_ext.estimators.planner.RandomOpGuard`). Where ``plans`` has a
    :class:`~lsn_ext.estimators.planner.Verified` for that structure, the backward passes go to
    the entries or the input, not to the weights, and every draw must reach exactly its module
    calls; otherwise every draw checks the capture against the batch weight gradients.

    Steps: the forward pass (:class:`~lsn_ext.estimators.capture.Capture`), the verified plan
    where one fits (:func:`_follow`), the independence check, the draws (:func:`_draws`), the
    whole-model path, and the result (:func:`_result`).

    Returns:
        The result, the call structure, and for a verified call whose input can carry a
        gradient, what it found.
    """
    whole = list(whole)
    leaves = [
        i for i, a in enumerate(args)
        if isinstance(a, Tensor) and a.is_floating_point() and not a.requires_grad
    ]  # fmt: skip
    fast = plans is not None and bool(leaves)  # a later call may skip the weights' gradients
    if fast:
        args = tuple(a.detach().requires_grad_(True) if i in leaves else a
                     for i, a in enumerate(args))  # fmt: skip
    capture = Capture(model, owners, args, [args[i] for i in leaves], fast)
    try:
        logits = capture.forward(args)
        check_logits(logits)
        f = logits.detach()
        check_finite_logits(f)
        structure = capture.structure()
        verified = plans.get(structure) if fast else None
        if verified is not None:
            _follow(verified, owners, whole)
        if verified is None or not verified.entries:
            capture.entries.clear()
        check_samples_independent(model, owners, args, bool(whole), (model_state, structure))
        value = loss_fn.value(f, targets)
        if noise is None:
            noise = _rademacher(f, mc_samples, generator)
        vectors = loss_fn.hessian_sqrt(f, targets, noise)
        sums = _draws(
            model, logits, vectors, mc_samples, names, chosen, owners, whole, capture, verified,
            noise, structure,
        )  # fmt: skip
    finally:
        capture.release()
    del logits
    if whole:
        sums.totals.update(
            whole_model(model, args, names, chosen, whole, vectors, f, sums.expected)
        )
    result = _result(names, chosen, owners, whole, sums.totals, mc_samples, value, f)
    found = None
    if verified is None and fast:
        found = Verified(frozenset(sums.captured), tuple(sums.rerouted), sums.first_fired)
    return result, structure, found


def _follow(verified: Verified, owners: list[Owner], whole: list[str]) -> None:
    """Take a verified call's plan: its rerouted parameters, and the owners that square alone.

    The rerouted parameters go to ``whole`` (in place); ``Owner.alone`` says which leaves
    square their own share.
    """
    for owner in owners:
        owner.names = {o: n for o, n in owner.names.items() if n not in verified.rerouted}
    whole += [n for n in verified.rerouted if n not in whole]
    # A leaf whose parameters no other owner holds, called once, squares its own share:
    # no sums over calls or owners, and no check against batch gradients in these calls.
    held = Counter(n for owner in owners for n in owner.names.values())
    for owner in owners:
        owner.alone = not owner.block and all(held[n] == 1 for n in owner.names.values())


def _rademacher(f: Tensor, mc_samples: int, generator: torch.Generator | None) -> Tensor:
    """The draws ``z``: ``[S, *f.shape]`` of ``±1``; refused where they overflow memory."""
    # Held at once: the draws z and the vectors s = B z, [S, *logits.shape] each.
    check_sample_memory(
        "mc_samples", mc_samples, 2 * f.numel(), f,
        "use a smaller mc_samples (the estimate's variance falls as 1/mc_samples; the "
        "mean of several calls with fewer samples is the same estimator), or a smaller "
        "batch",
    )  # fmt: skip
    shape = (mc_samples, *f.shape)
    noise = torch.randint(0, 2, shape, generator=generator, device=f.device)
    return noise.to(f.dtype) * 2 - 1


@dataclass
class _Sums:
    """What the draws of one pass add up (:func:`_draws`).

    Attributes:
        totals: ``Σ_s Σ_n (J_nᵀ s_n)²`` per parameter served by the capture.
        expected: ``Σ_s`` of the batch gradients of the parameters in ``whole`` (for the
            whole-model path's check).
        captured: The parameters whose per-sample gradients the capture delivered.
        rerouted: Parameters moved to the whole-model path in the first draw.
        first_fired: The module calls whose output gradient arrived in the first draw.
    """

    totals: dict[str, Tensor] = field(default_factory=dict)
    expected: dict[str, Tensor] = field(default_factory=dict)
    captured: set[str] = field(default_factory=set)
    rerouted: list[str] = field(default_factory=list)
    first_fired: frozenset[tuple[str, int]] = frozenset()


def _draws(
    model: nn.Module,
    logits: Tensor,
    vectors: Tensor,
    mc_samples: int,
    names: list[str],
    chosen: list[Tensor],
    owners: list[Owner],
    whole: list[str],
    capture: Capture,
    verified: Verified | None,
    noise: Tensor,
    structure: tuple,
) -> _Sums:
    """One backward pass per draw ``s = vectors[k]``, its checks, and the squares summed.

    Each draw's per-sample gradients are gathered from the owners (summed over the owners and
    calls of a parameter) and checked: against the batch gradients of a verified call
    (:func:`~lsn_ext.estimators.capture.gather`), or, after one, that the draw reached exactly
    the verified call's module calls (else :class:`~lsn_ext.estimators.planner.UnverifiedError`).
    Parameters lost in the first draw go to ``whole`` (in place) for all draws; a loss in a
    later draw is an error.
    """
    sums = _Sums()
    by_name = dict(zip(names, chosen, strict=True))
    for k in range(mc_samples):
        keep = k < mc_samples - 1
        if verified is None:
            grads = torch.autograd.grad(
                logits, chosen, vectors[k], retain_graph=keep, allow_unused=True
            )
            total_grads = dict(zip(names, grads, strict=True))
        else:  # to the entries or the input: the hooks fire, no batch weight gradients
            # beyond `whole`'s. An entry changed in place later (ReLU(inplace=True)) stands
            # for the changed tensor in autograd: the pass would stop short of its hook.
            entries = capture.entries
            intact = entries and all(t._version == v for t, v in entries)
            ends = [t for t, _ in entries] if intact else capture.inputs
            wanted = ends + [by_name[n] for n in whole]
            grads = torch.autograd.grad(
                logits, wanted, vectors[k], retain_graph=keep, allow_unused=True
            )
            total_grads = dict(zip(whole, grads[len(ends) :], strict=True))
        per_sample, lost = gather(owners, total_grads)
        squares = gather_squares(owners)
        if verified is not None and (
            set(per_sample) | set(squares) != verified.captured or capture.fired != verified.fired
        ):
            raise UnverifiedError(noise, structure, verified, at_entries=bool(intact))
        if k == 0:
            sums.first_fired = frozenset(capture.fired)
        capture.fired.clear()
        if lost and k == 0:
            # The capture cannot serve these: the whole model serves them, for all draws.
            for owner in owners:
                owner.names = {o: n for o, n in owner.names.items() if n not in lost}
            whole += [n for n in names if n in lost]
            sums.rerouted += [n for n in names if n in lost]
        elif lost:
            name, what = next(iter(lost.items()))
            raise_lost(model, name, owners, what)
        for name in whole:
            g = total_grads[name]
            if g is not None:
                sums.expected[name] = sums.expected[name] + g if name in sums.expected else g
        for name, g in per_sample.items():
            if name in lost:
                continue
            sums.captured.add(name)
            # In place: every per-sample gradient owns its memory (a new tensor from the
            # direct kernels or gather's sums, or own's copy of an alias of g).
            squares[name] = square_sum(g)
        for name, sq in squares.items():
            sums.totals[name] = sums.totals[name].add_(sq) if name in sums.totals else sq
    return sums


def _result(
    names: list[str],
    chosen: list[Tensor],
    owners: list[Owner],
    whole: list[str],
    totals: dict[str, Tensor],
    mc_samples: int,
    value: Tensor,
    f: Tensor,
) -> DiagBackpropResult:
    """The estimate: ``totals`` averaged over the draws (in place), with the paths.

    Parameters that no draw reached get zeros; the diagonals are checked to be finite, and
    ``mc_paths`` names how each parameter's per-sample gradients were taken.
    """
    if mc_samples > 1 and totals:  # the sums are this call's own tensors: averaged in place
        torch._foreach_div_(list(totals.values()), mc_samples)
    diagonals = {
        n: totals[n] if n in totals else torch.zeros_like(p)
        for n, p in zip(names, chosen, strict=True)
    }
    check_finite_result(diagonals, f.dtype, "Monte-Carlo")
    paths = dict.fromkeys(whole, BY_MODEL)
    for owner in owners:
        for n in owner.names.values():
            paths.setdefault(n, owner.how())
    mc_paths = {n: paths.get(n, BY_MODULE) for n in names}
    return DiagBackpropResult(loss=value.detach(), logits=f, diagonals=diagonals, mc_paths=mc_paths)
