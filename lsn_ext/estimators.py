r"""GGN-diagonal estimators beside plain diagonal backprop: Monte Carlo and calibrated DB.

Diagonal backprop (DB, :func:`~lsn_ext.diag_backprop`) is deterministic and costs one backward
pass, but it is biased: taking the diagonal after every layer drops the cross terms between
neighbouring pixels, and on trained networks these add up coherently, so DB underestimates the
curvature of every layer below the last one or two (see ``integration/bench_accuracy.py``).
:func:`ggn_diagonal` offers three estimators of ``diag Σ_n J_nᵀ H_n J_n`` from one entry point:

``"db"``
    Diagonal backprop: deterministic, one backward pass, biased.
``"mc"``
    Monte Carlo: with ``S`` vectors ``s = B z`` per sample, ``B Bᵀ = H_n``
    (:meth:`~lsn_ext.Loss.hessian_sqrt`) and Rademacher ``z``,

    .. math:: \hat d = \frac{1}{S} \sum_{s=1}^{S} \sum_n (J_n^\top s_n)^{\circ 2},
              \qquad E[\hat d] = \operatorname{diag} \sum_n J_n^\top H_n J_n .

    Unbiased for the exact diagonal, noisy (its variance falls as ``1/S``). Rademacher rather
    than Gaussian ``z`` (or BackPACK's sampled targets) removes the noise of the diagonal terms:
    for a single output the estimate is exact. Cost: one forward pass, ``S`` backward passes and
    one per-sample vector-Jacobian product per parametric layer, linear in the pixels (about 2× a
    training step for ``S = 1``).
``"db_calibrated"``
    DB's shape within each parameter tensor, rescaled so that the tensor's trace equals the
    Monte-Carlo estimate of its trace: ``c_ℓ · d^{DB}_ℓ`` with ``c_ℓ = Σ \hat d_ℓ / Σ d^{DB}_ℓ``.
    The DB traces are deterministic, so every tensor's trace is unbiased, with the Monte-Carlo
    trace's variance (measured on 4 nuclei patches of 32²: relative standard deviation 0.3–0.9
    per tensor for ``S = 1``, 0.12–0.17 for ``S = 16``, falling as ``1/√S`` and with more
    images). The split of the trace between the entries of a tensor is DB's and keeps DB's bias
    (on trained U-Nets the rank correlation within a lower layer's tensor can be anywhere in
    ``[−1, 1]``). With ``shrinkage = λ`` the result is ``(1 − λ) c_ℓ d^{DB}_ℓ + λ \hat d_ℓ``:
    ``λ = 1`` is the Monte-Carlo estimate, values in between trade DB's shape bias for
    Monte-Carlo variance. Cost: DB plus Monte Carlo.

Which to use (``integration/bench_accuracy.py``, ``integration/lsn_estimators.py``): on trained
U-Nets DB keeps 0.03–0.10 of the exact trace, and 10⁻⁶–10⁻³ of it in the encoder tensors that
hold most of it; Monte Carlo is unbiased (relative error 0.13–0.28 with ``S = 16`` on 4 images,
and a Laplace fit sums it over the whole data set). In the LSN experiment on nuclei patches the
uncertainty maps agree across estimators when the prior precision is tuned on validation NLL,
but with the marginal likelihood DB's small curvature picks a prior 10× too small and the LSN's
maps stop localising corruptions, while Monte Carlo's match the validation-tuned ones. Hence the
default ``"mc"`` (``S = 1``).

Per-sample gradients ``J_nᵀ s_n`` are taken per parametric leaf module, from the module's input
``x`` and the gradient ``g`` at its output: ``torch.func.vmap`` over the batch of one
vector-Jacobian product of the module alone (no Python loop over samples, and no per-layer
maths to register: any leaf module whose forward treats the samples independently works).
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode

from lsn_ext.engine import (
    DiagBackpropResult,
    _bind,
    _check_finite_logits,
    _check_finite_result,
    _check_inputs,
    _select_params,
    check_logits,
    diag_backprop,
)
from lsn_ext.rules import RULES, Rule, register_adapters_for
from lsn_ext.rules.losses import Loss, as_loss

__all__ = ["ESTIMATORS", "ggn_diagonal"]

Estimator = Literal["db", "db_calibrated", "mc"]
ESTIMATORS: tuple[str, ...] = ("db", "db_calibrated", "mc")


def ggn_diagonal(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    estimator: Estimator = "mc",
    mc_samples: int = 1,
    shrinkage: float = 0.0,
    generator: torch.Generator | None = None,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """The GGN diagonal of one batch by diagonal backprop, Monte Carlo, or calibrated DB.

    Args:
        model: The network, as for :func:`~lsn_ext.diag_backprop` (``"db"`` and
            ``"db_calibrated"``); ``"mc"`` runs on any model whose parameters belong to leaf
            modules that treat the samples of the batch independently.
        inputs: The model input, or a sequence of inputs passed as ``model(*inputs)``.
        targets: Targets for ``loss``.
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a ``torch.nn`` loss.
        estimator: ``"mc"`` (default), ``"db"`` or ``"db_calibrated"`` (see the module
            documentation).
        mc_samples: Monte-Carlo vectors ``S`` per sample (``"mc"``, ``"db_calibrated"``).
        shrinkage: ``λ ∈ [0, 1]``, the weight of the Monte-Carlo estimate in
            ``"db_calibrated"``.
        generator: Random generator for the Rademacher vectors (on the device of the logits).
        ce_first_step: For DB with cross-entropy, see :func:`~lsn_ext.diag_backprop`.
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and the diagonal per parameter; for ``"db_calibrated"`` also the
        scale ``c_ℓ`` per parameter tensor (``scales``).

    Raises:
        ValueError: An unknown estimator, ``mc_samples < 1``, ``shrinkage`` outside
            ``[0, 1]``, non-finite weights (naming the parameter) or inputs, an empty batch,
            bad targets, or anything :func:`~lsn_ext.diag_backprop` refuses.
        NotImplementedError: For ``"mc"``, a parameter that is not owned by a leaf module, a
            leaf module called with other than one tensor input of the batch's size, or dropout
            in training mode in ``forward`` (``F.dropout(x, training=True)``). A parameter tied
            across modules is supported: its per-sample gradients from all modules and calls
            are summed before squaring.
        TypeError: An integer input, or one whose dtype differs from the parameters'.
        FloatingPointError: Non-finite logits or diagonals (overflow), naming the parameter.
    """
    check_estimator(estimator, mc_samples, shrinkage)
    if estimator == "db":
        return diag_backprop(
            model, inputs, targets, loss, ce_first_step=ce_first_step, params=params
        )
    mc = _monte_carlo(model, inputs, targets, as_loss(loss), mc_samples, generator, params)
    if estimator == "mc":
        return mc
    db = diag_backprop(model, inputs, targets, loss, ce_first_step=ce_first_step, params=params)
    diagonals, scales = {}, {}
    for name, d in db.diagonals.items():
        m = mc.diagonals[name]
        trace = d.sum()
        if trace > 0:
            scales[name] = m.sum() / trace
            diagonals[name] = (1 - shrinkage) * scales[name] * d + shrinkage * m
        else:
            # DB sees no curvature in this tensor: there is no shape to rescale.
            scales[name] = torch.full_like(trace, float("nan"))
            diagonals[name] = m
    return DiagBackpropResult(db.loss, db.logits, diagonals, scales)


def check_estimator(estimator: str, mc_samples: int, shrinkage: float) -> None:
    """Raise a ``ValueError`` naming a bad estimator, sample count or shrinkage."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; use one of {ESTIMATORS}")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage}")
    if shrinkage and estimator != "db_calibrated":
        raise ValueError("shrinkage applies to estimator='db_calibrated' only")


class _Bare(nn.Module):
    """Calls ``module.forward`` without the module's hooks (for the per-sample replay)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module

    def forward(self, x: Tensor) -> Tensor:
        return self.m.forward(x)


# Modules that torch refuses to run on a batch of one in some shapes although they treat samples
# independently (GroupNorm over one value per group: "Expected more than 1 value per channel").
# Their per-sample replay runs the sample next to a copy of itself with a zero cotangent.
_PAIRED_REPLAY: tuple[type[nn.Module], ...] = (nn.GroupNorm,)


class _Owner:
    """A leaf module owning parameters to estimate: calls, per-sample gradients, the result."""

    def __init__(self, module: nn.Module, path: str, names: dict[str, str]):
        self.module, self.path, self.names = module, path, names  # own name → model name
        self.bare = _Bare(module)
        self.paired = isinstance(module, _PAIRED_REPLAY)
        self.calls = 0
        self.partial: dict[str, Tensor] | None = None

    def sample_grads(self, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        """``J_nᵀ g_n`` w.r.t. this module's parameters, per sample: ``{name: [N, *shape]}``."""
        params = {f"m.{n}": getattr(self.module, n).detach() for n in self.names}

        def one(x_n: Tensor, g_n: Tensor) -> dict[str, Tensor]:
            x_n, g_n = x_n.unsqueeze(0), g_n.unsqueeze(0)
            if self.paired:
                x_n, g_n = torch.cat([x_n, x_n]), torch.cat([g_n, torch.zeros_like(g_n)])

            def f(p: dict[str, Tensor]) -> Tensor:
                return functional_call(self.bare, p, (x_n,))

            return vjp(f, params)[1](g_n)[0]

        return {k[2:]: v for k, v in vmap(one)(x, g).items()}

    def add(self, grads: dict[str, Tensor]) -> None:
        """Sum a call's per-sample gradients into this draw's."""
        if self.partial is None:
            self.partial = grads
        else:
            self.partial = {k: v + grads[k] for k, v in self.partial.items()}

    def describe(self) -> str:
        """``'path' (Class)`` for error messages."""
        return f"'{self.path}' ({type(self.module).__name__})"


def _flush(
    owners: list[_Owner],
    total_grads: dict[str, Tensor | None],
    totals: dict[str, Tensor],
) -> None:
    """Check one draw's per-sample gradients against autograd's, then square and add them.

    The per-sample gradients of a parameter are summed over all its owners (a weight tied
    across modules) and all their calls first, then squared: ``(Σ_modules J_nᵀ s_n)²``.
    ``total_grads`` maps the model's parameter names to ``Σ_n J_nᵀ s_n`` from one ordinary
    backward pass. A parameter that autograd reaches must have been captured, and its
    per-sample gradients must sum to autograd's (to round-off relative to the larger of their
    magnitude): a capture that did not fire, or fired for some of the module's calls only, would
    otherwise give a silently wrong, too small estimate. Round-off in a tensor whose gradient is
    structurally zero is relative to the largest gradient entry of the model in this draw; a
    tensor whose gradients are all below ``√eps`` of that entry is not checked (its squares
    are below ``eps`` of the draw's largest, and rounding can be amplified there).
    """
    floor = max((float(g.abs().max()) for g in total_grads.values() if g is not None), default=0.0)
    per_sample: dict[str, Tensor] = {}
    where: dict[str, list[_Owner]] = {}
    for owner in owners:
        for own, name in owner.names.items():
            where.setdefault(name, []).append(owner)
            if owner.partial is not None:
                g = owner.partial[own]
                per_sample[name] = per_sample[name] + g if name in per_sample else g
        owner.partial = None
    for name, expected in total_grads.items():
        if expected is None or name not in where:
            continue
        got = per_sample.get(name)
        if got is None:
            _lost(name, where[name], "none arrived")
        scale = max(float(got.abs().sum(0).max()), float(expected.abs().max()))
        err = float((got.sum(0) - expected).abs().max())
        eps = torch.finfo(expected.dtype).eps
        if scale <= math.sqrt(eps) * floor:
            # Gradients at round-off level, e.g. zero in exact arithmetic but amplified noise
            # (GroupNorm over one value per group: x̂ = 0 up to rounding / √eps_gn). Whatever
            # the capture did, their squares are below eps of the draw's largest: no check.
            continue
        if not err <= max(1e3 * eps, 1e-9) * scale + 1e3 * eps * floor:
            _lost(
                name,
                where[name],
                f"they sum to a different gradient ({err:.3g} off at {scale:.3g})",
            )
    for name, g in per_sample.items():
        sq = g.square().sum(0)
        totals[name] = totals[name] + sq if name in totals else sq


def _lost(name: str, owners: list[_Owner], what: str) -> None:
    modules = " and ".join(o.describe() for o in owners)
    raise RuntimeError(
        f"the Monte-Carlo estimator lost the per-sample gradients of '{name}' in {modules}: "
        f"{what}, although the parameter reaches the output. Something after the module "
        "bypasses the output it returned (an in-place operation on it?). Write that operation "
        "out of place, or use estimator='db'"
    )


class _RandomOpGuard(TorchFunctionMode):
    """Refuses train-mode functional dropout in ``forward`` (a random Jacobian), as DB does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in _DROPOUT and torch.is_grad_enabled():
            bound = _bind(args, kwargs, (("p", 0.5), ("training", True), ("inplace", False)))
            if bound["training"] and bound["p"] > 0:
                module = _current_module(self.model)
                where = "the model" if module is None else f"{_describe(self.model, module)}"
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


def _describe(model: nn.Module, module: nn.Module) -> str:
    return f"'{_path(model, module)}' ({type(module).__name__})"


def _monte_carlo(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss_fn: Loss,
    mc_samples: int,
    generator: torch.Generator | None,
    params: Sequence[Tensor] | None,
    noise: Tensor | None = None,
) -> DiagBackpropResult:
    """The Monte-Carlo GGN diagonal (see the module documentation).

    ``noise`` (``[S, *logits.shape]``) replaces the Rademacher vectors ``z``, for tests.

    Each call of an owning module taps its output with a tensor hook that receives ``g``, the
    gradient at the output. A view (InstanceNorm returns one) loses its hooks when an in-place
    operation follows (``LeakyReLU(inplace=True)``), so such an output is replaced by a copy
    that carries the hook. Every draw is checked: the per-sample gradients of each parameter
    must sum to the gradient of an ordinary backward pass.
    """
    names, chosen = _select_params(model, params)
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    _check_inputs(model, args)
    owners = _owners(model, names, chosen)
    handles: list[Any] = []
    taps: list[Any] = []  # the tensor hooks, removed after the backward passes
    state = {"batch": args[0].shape[0] if args and isinstance(args[0], Tensor) else None}

    def check(module: nn.Module, _args: Any) -> None:
        try:
            RULES[type(module)].check(module)
        except ValueError as err:
            raise ValueError(f"'{_path(model, module)}' ({type(module).__name__}): {err}") from None

    def capture(owner: _Owner):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) was called with {len(args)} "
                    f"positional and {len(kwargs)} keyword arguments; the Monte-Carlo estimator "
                    "takes per-sample gradients of leaf modules with one tensor input"
                )
            x = args[0].detach()
            if not isinstance(out, Tensor) or x.shape[0] != state["batch"]:
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) gets an input of shape "
                    f"{tuple(x.shape)} whose first dimension is not the batch "
                    f"({state['batch']}): per-sample gradients need the samples along dim 0"
                )
            if not out.requires_grad:
                return None
            tapped = out.clone() if out._is_view() else out
            owner.calls += 1
            taps.append(tapped.register_hook(lambda g: owner.add(owner.sample_grads(x, g))))
            return tapped if tapped is not out else None

        return hook

    register_adapters_for(model)
    try:
        try:
            for module in {id(m): m for m in model.modules()}.values():
                rule = RULES.get(type(module))
                if rule is not None and type(rule).check is not Rule.check:
                    handles.append(module.register_forward_pre_hook(check))
            for owner in owners:
                handles.append(owner.module.register_forward_hook(capture(owner), with_kwargs=True))
            with torch.enable_grad(), _RandomOpGuard(model):
                logits = model(*args)
        finally:
            for handle in handles:
                handle.remove()
        check_logits(logits)
        f = logits.detach()
        _check_finite_logits(f)
        _check_samples_independent(model, owners, args)
        value = loss_fn.value(f, targets)
        if noise is None:
            shape = (mc_samples, *f.shape)
            noise = torch.randint(0, 2, shape, generator=generator, device=f.device)
            noise = noise.to(f.dtype) * 2 - 1
        vectors = loss_fn.hessian_sqrt(f, targets, noise)
        totals: dict[str, Tensor] = {}
        for k in range(mc_samples):
            grads = torch.autograd.grad(
                logits, chosen, vectors[k], retain_graph=k < mc_samples - 1, allow_unused=True
            )
            if k == 0:
                _check_called(owners, names, grads)
            _flush(owners, dict(zip(names, grads, strict=True)), totals)
    finally:
        # The hooks hold the module inputs; removing them lets the graph go with the call.
        for tap in taps:
            tap.remove()
        for owner in owners:
            owner.partial = None
    diagonals = {
        n: totals[n] / mc_samples if n in totals else torch.zeros_like(p)
        for n, p in zip(names, chosen, strict=True)
    }
    _check_finite_result(diagonals, f.dtype, "Monte-Carlo")
    return DiagBackpropResult(loss=value.detach(), logits=f, diagonals=diagonals)


# (model, input shapes and dtypes) already checked by _check_samples_independent.
_INDEPENDENT: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()


def _check_samples_independent(model: nn.Module, owners: list[_Owner], args: tuple) -> None:
    """Verify once per model and input shape that dim 0 of every owner's input is the batch.

    Per-sample gradients split each owning module's input along dim 0. A module whose input
    has the batch's size in dim 0 without it being the batch (a sequence-first ``[L, N, E]``
    tensor with ``L = N``) would be split wrongly, and the sums the per-draw check compares
    still agree: a silently biased estimate. Here one forward and one backward pass (no
    forward-mode AD needed) measure whether any row ``j ≠ 0`` of an owner's input depends on
    sample 0 of the model's inputs; if so the module is named.

    Raises:
        NotImplementedError: Naming the module whose dim 0 mixes samples.
    """
    tensors = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
    batch = tensors[0].shape[0] if tensors else 0
    if batch < 2 or not owners:
        return
    key = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, Tensor))
    done = _INDEPENDENT.setdefault(model, set())
    if key in done:
        return
    leaves = [
        a.detach().requires_grad_(True) if isinstance(a, Tensor) and a.is_floating_point()
        else a
        for a in args
    ]  # fmt: skip
    seen: list[tuple[_Owner, Tensor]] = []

    def record(owner: _Owner):
        def hook(module: nn.Module, hook_args: tuple) -> None:
            if hook_args and isinstance(hook_args[0], Tensor) and hook_args[0].requires_grad:
                seen.append((owner, hook_args[0]))

        return hook

    handles = [o.module.register_forward_pre_hook(record(o)) for o in owners]
    try:
        with torch.enable_grad(), _RandomOpGuard(model):
            model(*leaves)
    finally:
        for handle in handles:
            handle.remove()
    inputs = [a for a in leaves if isinstance(a, Tensor) and a.requires_grad]
    generator = torch.Generator(device=inputs[0].device).manual_seed(0)

    def leak(pairs: list[tuple[_Owner, Tensor]]) -> bool:
        terms = [
            (x[1:] * torch.randn(x[1:].shape, generator=generator, dtype=x.dtype, device=x.device))
            .sum()
            for _, x in pairs
            if x.shape[0] == batch
        ]  # fmt: skip
        if not terms:
            return False
        grads = torch.autograd.grad(sum(terms), inputs, allow_unused=True, retain_graph=True)
        return any(g is not None and bool((g[0] != 0).any()) for g in grads)

    if leak(seen):
        bad = next(o for o, x in seen if leak([(o, x)]))
        raise NotImplementedError(
            f"{bad.describe()} gets inputs whose dim 0 has the batch's size ({batch}) but "
            "mixes the samples: other rows of it depend on sample 0 (a sequence-first "
            "[L, N, E] tensor with L = N?). The Monte-Carlo estimator splits a module's input "
            "along dim 0 into samples: give the module batch-first inputs (e.g. "
            "nn.MultiheadAttention(..., batch_first=True)), or use estimator='db' where it "
            "has rules"
        )
    done.add(key)


def _path(model: nn.Module, module: nn.Module) -> str:
    return next((n or "<model>" for n, m in model.named_modules() if m is module), "?")


def _owners(model: nn.Module, names: list[str], chosen: list[Tensor]) -> list[_Owner]:
    """The leaf modules that own the chosen parameters; refuse parameters of non-leaf modules.

    A parameter tied across modules (``b.weight = a.weight``) has several owners; their
    per-sample gradients are summed before squaring (:func:`_flush`).
    """
    wanted = {id(p): n for n, p in zip(names, chosen, strict=True)}
    owners = []
    for path, module in model.named_modules():
        own = {n: wanted[id(p)] for n, p in module._parameters.items() if id(p) in wanted}
        if not own:
            continue
        if module._modules:
            raise NotImplementedError(
                f"parameter '{next(iter(own.values()))}' belongs to '{path or '<model>'}' "
                f"({type(module).__name__}), which has submodules: the Monte-Carlo estimator "
                "takes per-sample gradients per leaf module. Move the parameter into a leaf "
                "module of its own"
            )
        owners.append(_Owner(module, path or "<model>", own))
    return owners


def _check_called(owners: list[_Owner], names: list[str], grads: Sequence[Tensor | None]):
    """A parameter with a gradient must have been seen through its module's forward."""
    called = {name for o in owners if o.calls for name in o.names.values()}
    for name, g in zip(names, grads, strict=True):
        if g is not None and name not in called:
            raise NotImplementedError(
                f"parameter '{name}' influences the output without its module being called "
                "(used directly in another module's forward?); the Monte-Carlo estimator needs "
                "every parameter to act through its own leaf module"
            )
