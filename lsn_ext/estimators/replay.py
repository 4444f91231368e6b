"""Per-sample replay: the owners of parameters, and replays of a leaf, a block or the whole model.

An :class:`Owner` is a module whose parameters the Monte-Carlo estimator serves from its calls:
a leaf module (its per-sample gradients from
:func:`~lsn_ext.estimators.per_sample.direct_sample_grads` or from a per-sample replay of the
module alone) or a *block*, an enclosing module replayed whole per sample. :func:`whole_model`
takes the per-sample gradients of the parameters that no owner can serve through the whole
model. Every replay checks that it reproduces the batched forward pass.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from lsn_ext._functional import functional_call_all
from lsn_ext.engine import round_off, sum_tolerance
from lsn_ext.estimators.per_sample import direct_kernel, direct_sample_grads, own, square_sum


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

# A block or the whole model replayed per sample (torch.func) runs on chunks of samples whose
# per-sample gradients hold at most about this many numbers (at least one sample per chunk).
_REPLAY_NUMBERS = 2**24

# How the per-sample gradients of a parameter were taken (``DiagBackpropResult.mc_paths``).
BY_MODULE, BY_MODEL = "module", "model"


class Owner:
    """A module owning parameters to estimate: calls, per-sample gradients, the result.

    A leaf module (``block=False``) is replayed alone on each sample, from its captured input
    and output gradient. A *block* (``block=True``) is the smallest enclosing module that the
    capture can serve when the leaf cannot (parameters held by a module with submodules,
    parametrizations, a leaf called on folded or several inputs): the whole block is replayed
    per sample with :func:`torch.func.vmap` over :func:`torch.func.vjp` of
    :func:`torch.func.functional_call`. ``names`` maps the parameter's path inside the module
    to its name in the model.
    """

    def __init__(self, module: nn.Module, path: str, names: dict[str, str], block: bool = False):
        self.module, self.path, self.names = module, path, names  # own name → model name
        self.block = block
        self.paired = isinstance(module, _PAIRED_REPLAY) and not block
        self.direct = not block  # try direct_sample_grads
        self.calls = 0
        self.partial: dict[str, Tensor] | None = None
        self.squares: dict[str, Tensor] | None = None  # this draw's Σ_n of squares (alone)
        self.alone = False  # whether sample_squares may serve (set per call by the pass)

    @functools.cached_property
    def bare(self) -> _Bare:
        """The module without its hooks, for the replays.

        Built on first use: most owners of a plain network never replay, and an ``nn.Module``
        per owner and call costs.
        """
        return _Bare(self.module)

    @property
    def may_replay(self) -> bool:
        """Whether this call's gradients may come from a replay, which checks its outputs.

        ``False`` for a leaf that a direct kernel serves (:func:`direct_kernel`: torch's own
        classes, whose forward cannot depend on the batch without a gradient path); the capture
        then keeps no reference to its output, which would hold every activation of the network
        until the backward pass reached it. Where such a kernel fails at run time (another
        padding mode), the module is replayed without the output check.
        """
        return self.block or not self.direct or direct_kernel(self.module) is None

    def sample_grads(self, x: Tensor, g: Tensor, out: Tensor | None = None) -> dict[str, Tensor]:
        """``J_nᵀ g_n`` w.r.t. this module's parameters, per sample: ``{name: [N, *shape]}``.

        Plain convolutions and ``nn.Linear`` take their weight gradients directly
        (:func:`direct_sample_grads`); other modules are replayed per sample, and the replayed
        outputs must equal ``out``, the module's output in the batched forward pass (where
        given: a module whose forward depends on the batch without a gradient path, such as a
        branch on ``x.mean()``, fails here instead of giving a wrong estimate).
        """
        if self.direct:
            direct = direct_sample_grads(self.module, self.names, x, g)
            if direct is not None:
                return direct
            self.direct = False
        params = {f"m.{n}": getattr(self.module, n).detach() for n in self.names}

        def one(x_n: Tensor, g_n: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            x_n, g_n = x_n.unsqueeze(0), g_n.unsqueeze(0)
            if self.paired:
                x_n, g_n = torch.cat([x_n, x_n]), torch.cat([g_n, torch.zeros_like(g_n)])

            def f(p: dict[str, Tensor]) -> Tensor:
                return functional_call(self.bare, p, (x_n,))

            y, pull = vjp(f, params)
            return y[0], pull(g_n)[0]

        # Some kernels refuse non-contiguous gradients (a permuted output: "grad_weight needs to
        # be contiguous" in transposed convolutions after a rearrange).
        x, g = x.contiguous(), g.contiguous()
        y, grads = _map(one, x, g)
        if out is not None:
            _check_replay(y, out, f"the module {self.describe()}")
        return {k[2:]: own(v, x, g) for k, v in grads.items()}

    def sample_squares(self, x: Tensor, g: Tensor, out: Tensor | None = None) -> dict[str, Tensor]:
        """``Σ_n (J_nᵀ g_n)²`` w.r.t. this module's parameters: ``{name: shape}``.

        A leaf's share of one draw where nothing else adds to its per-sample gradients (see
        :func:`~lsn_ext.estimators.monte_carlo.monte_carlo`): the direct kernels accumulate the
        squares without keeping ``[N, *shape]``
        (:func:`~lsn_ext.estimators.per_sample.direct_sample_grads`).
        """
        if self.direct:
            direct = direct_sample_grads(self.module, self.names, x, g, squared=True)
            if direct is not None:
                return direct
            self.direct = False
        return {k: square_sum(v) for k, v in self.sample_grads(x, g, out).items()}

    def block_grads(self, x: Tensor, g: Tensor, out: Tensor) -> dict[str, Tensor]:
        """As :meth:`sample_grads` for a block, replayed whole per sample (chunked).

        The replayed outputs must equal the block's output in the batched forward pass: a block
        whose forward mixes the samples would fail here instead of giving a wrong estimate.
        """
        params = {f"m.{n}": self.module.get_parameter(n).detach() for n in self.names}

        def one(x_n: Tensor, g_n: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            def f(p: dict[str, Tensor]) -> Tensor:
                return functional_call_all(self.bare, p, (x_n.unsqueeze(0),))

            y, pull = vjp(f, params)
            return y.squeeze(0), pull(g_n.unsqueeze(0))[0]

        def eager(x_n: Tensor, g_n: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            def f(p: dict[str, Tensor]) -> Tensor:
                return functional_call_all(self.bare, p, (x_n.unsqueeze(0),))

            y, (grads,) = _eager_vjp(f, params, [g_n.unsqueeze(0)])
            return y.squeeze(0), grads

        size = _chunk(x.shape[0], sum(p.numel() for p in params.values()))
        try:
            y, grads = _map(one, x.contiguous(), g.contiguous(), chunk=size, eager=eager)
        except Exception as err:
            raise NotImplementedError(
                f"the Monte-Carlo estimator could not replay the block {self.describe()} per "
                "sample with torch.func.vmap (it replays the whole block because per-module "
                f"capture cannot serve its parameters): {type(err).__name__}: {err}"
            ) from err
        _check_replay(y, out, f"block {self.describe()}")
        return {k[2:]: own(v, x, g) for k, v in grads.items()}

    def add(self, grads: dict[str, Tensor]) -> None:
        """Sum a call's per-sample gradients into this draw's."""
        if self.partial is None:
            self.partial = grads
        else:
            self.partial = {k: v + grads[k] for k, v in self.partial.items()}

    def describe(self) -> str:
        """``'path' (Class)`` for error messages."""
        return f"'{self.path}' ({type(self.module).__name__})"

    def how(self) -> str:
        """The entry of ``mc_paths`` for this owner's parameters."""
        return f"block '{self.path}'" if self.block else BY_MODULE


def _map(
    fn: Callable[..., Any],
    *args: Any,
    chunk: int | None = None,
    eager: Callable[..., Any] | None = None,
) -> Any:
    """``vmap(fn)`` over dim 0 of every tensor in ``args``, or a loop where vmap fails.

    The loop (over ``eager`` if given, an ordinary-autograd version of ``fn``, else ``fn``)
    serves where vmap fails: a batching rule that torch lacks or gets wrong ("grad_weight needs
    to be contiguous" from a transposed convolution on a 1×1 input), or non-reentrant
    ``torch.utils.checkpoint``, whose saved-tensor hooks torch.func refuses. Both give the
    same numbers.
    """
    try:
        with warnings.catch_warnings():
            # torch's note that an op runs through its slower generic batching fallback.
            warnings.filterwarnings("ignore", message="There is a performance drop because")
            return vmap(fn, chunk_size=chunk)(*args)
    except RuntimeError:
        pass
    flat, spec = tree_flatten(args)
    outs = []
    for i in range(flat[0].shape[0]):
        outs.append((eager or fn)(*tree_unflatten([t[i] for t in flat], spec)))
    leaves = [tree_flatten(o)[0] for o in outs]
    stacked = [torch.stack(column) for column in zip(*leaves, strict=True)]
    return tree_unflatten(stacked, tree_flatten(outs[0])[1])


def _eager_vjp(
    f: Callable[[dict[str, Tensor]], Tensor], params: dict[str, Tensor], cotangents: list[Tensor]
) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """``f(params)`` and its vector-Jacobian products by ordinary autograd (no torch.func)."""
    with torch.enable_grad():
        leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        y = f(leaves)
        results = []
        for i, c in enumerate(cotangents):
            grads = torch.autograd.grad(
                y, list(leaves.values()), c, retain_graph=i < len(cotangents) - 1,
                allow_unused=True,
            )  # fmt: skip
            results.append(
                {
                    k: torch.zeros_like(p) if gr is None else gr
                    for (k, p), gr in zip(leaves.items(), grads, strict=True)
                }
            )
    return y.detach(), results


def _chunk(batch: int, numbers: int) -> int:
    """Samples per replay chunk: per-sample gradients of ``numbers`` entries each."""
    return max(1, min(batch, _REPLAY_NUMBERS // max(numbers, 1)))


def _check_replay(replayed: Tensor, batched: Tensor, what: str) -> None:
    """The per-sample replay must reproduce the batched forward (else samples are mixed)."""
    replayed = replayed.detach()
    if replayed.shape != batched.shape:
        raise NotImplementedError(
            f"the per-sample replay of {what} returned shape {tuple(replayed.shape)} where the "
            f"batched forward gave {tuple(batched.shape)}: its forward does not treat the "
            "samples of dim 0 independently"
        )
    eps = round_off(batched)
    scale = float(batched.abs().max()) if batched.numel() else 0.0
    err = float((replayed - batched).abs().max()) if batched.numel() else 0.0
    if not err <= math.sqrt(eps) * (1.0 + scale):
        raise NotImplementedError(
            f"the per-sample replay of {what} differs from the batched forward ({err:.3g} off "
            f"at {scale:.3g}): its forward does not treat the samples independently (batch "
            "statistics, training-mode normalisation, a state that changes between calls?). "
            "Per-sample gradients, and with them the Monte-Carlo estimator, are undefined for "
            "it; call model.eval(), or use estimator='db' where it has rules"
        )


def whole_model(
    model: nn.Module,
    args: tuple,
    names: list[str],
    chosen: list[Tensor],
    whole: list[str],
    vectors: Tensor,
    logits: Tensor,
    expected: dict[str, Tensor],
) -> dict[str, Tensor]:
    """``Σ_s Σ_n (J_nᵀ s_n)²`` for the parameters ``whole``, per sample through the whole model.

    ``vmap`` over the samples of ``vjp`` of ``functional_call`` (the model's parameters swapped
    for detached copies and restored: the model is left as found), with the Monte-Carlo vectors
    ``s`` as the output cotangents, in chunks of samples (:data:`_REPLAY_NUMBERS`). Checked:
    each sample's replayed output equals the batched logits, and the per-sample gradients sum
    to the batch gradients of the draws (``expected``).
    """
    batch = logits.shape[0]
    params = {n: p.detach() for n, p in zip(names, chosen, strict=True) if n in whole}
    batched = [
        i for i, a in enumerate(args)
        if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch
    ]  # fmt: skip
    draws = vectors.shape[0]

    def on_sample(xs: tuple[Tensor, ...]) -> Callable[[dict[str, Tensor]], Tensor]:
        """The model as a function of ``params`` on one sample (``xs``: its batched arguments)."""
        full = list(args)
        for i, x_n in zip(batched, xs, strict=True):
            full[i] = x_n.unsqueeze(0)
        return lambda p: functional_call_all(model, p, tuple(full))

    def stacked(y: Tensor, grads: list[dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        return y.squeeze(0), {n: torch.stack([g[n] for g in grads]) for n in params}

    def one(xs: tuple[Tensor, ...], v: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        y, pull = vjp(on_sample(xs), params)
        return stacked(y, [pull(v[k].unsqueeze(0))[0] for k in range(draws)])

    def eager(xs: tuple[Tensor, ...], v: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return stacked(
            *_eager_vjp(on_sample(xs), params, [v[k].unsqueeze(0) for k in range(draws)])
        )

    size = _chunk(batch, draws * sum(p.numel() for p in params.values()))
    squares: dict[str, Tensor] = {n: torch.zeros_like(p) for n, p in params.items()}
    sums: dict[str, Tensor] = {n: torch.zeros_like(p) for n, p in params.items()}
    for start in range(0, batch, size):
        part = slice(start, start + size)
        try:
            y, grads = _map(
                one,
                tuple(args[i][part] for i in batched),
                vectors[:, part].movedim(0, 1),
                eager=eager,
            )
        except NotImplementedError:
            raise
        except Exception as err:
            raise NotImplementedError(
                "the Monte-Carlo estimator takes the per-sample gradients of "
                f"{_few(list(params))} through the whole model with torch.func (vmap over the "
                "samples of vjp of functional_call), because per-module capture cannot serve "
                f"them, and that replay failed: {type(err).__name__}: {err}"
            ) from err
        _check_replay(y, logits[part], "the whole model")
        for n, g in grads.items():
            g = g.detach()
            squares[n] += g.square().sum((0, 1))
            sums[n] += g.sum((0, 1))
    floor = max((float(g.abs().max()) for g in expected.values()), default=0.0)
    for n, got in sums.items():
        want = expected.get(n, torch.zeros_like(got))
        eps = round_off(got)
        tol = sum_tolerance(eps)
        scale = max(float(got.abs().max()), float(want.abs().max()))
        err = float((got - want).abs().max())
        if scale > math.sqrt(eps) * floor and not err <= tol * (scale + floor) + 1e-9 * scale:
            raise RuntimeError(
                f"the per-sample gradients of '{n}' through the whole model sum to a different "
                f"gradient than the batch's ({err:.3g} off at {scale:.3g}): the model's forward "
                "does not treat the samples independently, or differs between calls"
            )
    return squares


def _few(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
