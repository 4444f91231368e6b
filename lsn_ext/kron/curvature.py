r"""Kronecker-factored GGN over all weights of a network, in laplace-torch's ``Kron`` format.

:func:`kron_curvature` captures, in one forward pass and one backward pass per Monte-Carlo
draw, the inputs of every ``Linear``, ``Conv1–3d`` and ``ConvTranspose1–3d`` (forward hooks)
and the gradients at their outputs (tensor hooks on the outputs). The backward passes start
from ``s = B z``, ``B Bᵀ = H`` the loss Hessian w.r.t. the logits
(:meth:`~lsn_ext.Loss.hessian_sqrt`, in closed form for BCE, cross-entropy and MSE) and
Rademacher ``z`` (``E[z zᵀ] = I``), so ``E[s sᵀ] = H`` and every second moment of the output
gradients is, in expectation, that of the GGN ``Σ_n J_nᵀ H_n J_n``. For one BCE channel the
square root is exact (``√h`` per pixel, no sampling of labels) and, with KFAC-expand, a 1×1
output layer's ``G`` is exact for every draw (``z² = 1``); the other factors keep the noise of
the cross-pixel terms ``z_p z_q``, ``p ≠ q``, which have mean zero (making them exact would take
one backward pass per output pixel). ``mc_samples="exact"`` replaces ``z`` by the scaled unit
vectors of every logit entry (one backward pass each): the factors' expectation, for tests and
tiny outputs.

Per weight ``W`` (``[R, *D]``, see :mod:`lsn_ext.kron.layers` for rows ``r`` and columns
``c``), with ``M`` samples in the batch, ``N`` in the data set, ``T`` positions per sample,
``g`` groups and ``S`` draws:

.. math::
    \text{expand: } F_0 = \tfrac{1}{S}\textstyle\sum_{s,n,t} r r^\top, \quad
    F_1 = \tfrac{1}{g N T}\textstyle\sum_{n,t,j} c c^\top;
    \qquad
    \text{reduce: } F_0 = \tfrac{1}{S}\textstyle\sum_{s,n} \bar r \bar r^\top, \quad
    F_1 = \tfrac{1}{g N}\textstyle\sum_{n,j} \tilde c \tilde c^\top

with ``r̄ = Σ_t r`` and ``c̃ = (1/T) Σ_t c`` (the factor that holds the draws, ``F_0`` for
``Linear``/``Conv``, ``F_1`` for transposed convolutions, is averaged over them). This is
laplace-torch's convention (curvlinops' KFAC and ``CurvlinopsInterface._rescale_kron_factors``):
``F_0`` sums over the batch, ``F_1`` is the batch mean scaled by ``M/N``, so that
``KronLaplace.fit`` can add the factors of all batches. A bias of a KFAC layer gets its own
entry ``[B]`` (``[C_out, C_out]``, laplace-torch's ``separate_weight_and_bias=True`` layout):
by default (``bias_block="exact"``) the per-sample moment ``Σ_n (Σ_t g)(Σ_t g)ᵀ`` of the output
gradients, the bias's exact GGN block in expectation; with ``bias_block="kfac"`` the weight's
output-gradient factor as laplace-torch + curvlinops give it, which for KFAC-expand drops the
cross-position terms (``integration/results/kron_expand_reduce.md``: relative errors of 0.06 to
0.8 for expand's, 0 for the exact block, at the same cost).

Cost. KFAC-expand's column factor takes ``M T D²`` multiply-adds per call (``D = C_in · ∏k``
for a convolution), ``D / C_out`` times the layer's forward pass: most of KFAC-expand's time on
convolutional networks (``integration/results/bench_speed.md``). The patches are gathered tap by
tap from the padded input (:meth:`~lsn_ext.kron.layers.Columns.gram`), not copied from the
im2col view. ``position_fraction < 1`` builds it from a random subset of each sample's
positions, weighted to stay unbiased, at that fraction of the cost and with added noise
(``integration/results/kron_expand_reduce.md`` measures it); KFAC-reduce's only sums the
patches.

Every other parameter (norm affines, PReLU, attention projections that are not ``nn.Linear``
calls, embeddings, a weight held by several modules) gets a block from its gradients
(:class:`~lsn_ext.kron.factors.OtherBlock`): per-sample gradients where the leaf module holding
it can be replayed per sample (``torch.func.vmap`` of one vector-Jacobian product of the module
alone, checked against the batched output and the batch gradient), else the batch gradient
(unbiased, with more variance). ``KronResult.paths`` says which, per parameter.

Assumptions (as for lsn_ext's Monte-Carlo diagonal): the samples lie along dim 0 of the input
and of every module's input and output, and the forward pass treats them independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from lsn_ext._laplace import laplace
from lsn_ext._memory import check_sample_memory
from lsn_ext.kron.factors import Mode, Moment, OtherBlock, kind_of
from lsn_ext.kron.layers import (
    KFAC_TYPES,
    TRANSPOSED,
    Columns,
    check_input,
    columns,
    describe,
    groups_of,
    output_rows,
    projected_columns,
    rows,
)
from lsn_ext.rules.losses import Loss, as_loss

__all__ = ["KronResult", "check_kron_options", "kron_curvature"]

Kron = laplace.utils.matrix.Kron


@dataclass
class KronResult:
    """What :func:`kron_curvature` returns.

    Attributes:
        loss: The loss on the batch (detached scalar).
        kron: laplace-torch's ``Kron``: one entry per trainable parameter, in
            ``model.parameters()`` order: ``[F_0, F_1]`` (sizes ``p.shape[0]`` and
            ``∏ p.shape[1:]``) for a parameter of ≥ 2 dims, ``[B]`` (``[P, P]``) otherwise.
        names: The parameters' names, in the order of ``kron.kfacs``.
        blocks: Per name: ``"kfac"`` (a layer's weight), ``"kfac bias"``, ``"full"``,
            ``"diagonal"`` (stored dense), ``"nearest kron"`` or ``"kron moments"``.
        paths: Per name: ``"layer"`` (the KFAC capture), ``"per-sample"`` (its module replayed
            per sample), ``"batch gradient"``, or ``"unused"`` (no gradient reached it: a zero
            block).
        logits: The model's output (detached).
    """

    loss: Tensor
    kron: Kron
    names: list[str]
    blocks: dict[str, str]
    paths: dict[str, str]
    logits: Tensor

    def factors(self, name: str) -> list[Tensor]:
        """The ``Kron`` entry of the parameter ``name``.

        Args:
            name: The parameter's name, one of :attr:`names`.

        Returns:
            ``[F_0, F_1]`` for a parameter of ≥ 2 dims, ``[B]`` otherwise.

        Raises:
            ValueError: If ``name`` is not in :attr:`names`.
        """
        return self.kron.kfacs[self.names.index(name)]


def _tolerance(dtype: torch.dtype) -> float:
    return math.sqrt(torch.finfo(dtype).eps)


@dataclass
class _Layer:
    """The capture of one KFAC module: its calls' inputs and the moments of both sides."""

    path: str
    module: nn.Module
    weight: str | None  # the parameter's name in the model, if it gets a KFAC block
    bias: str | None
    mode: Mode
    bias_mode: Mode  # "reduce": the bias's exact block; the weight's mode: its G
    batch: int
    fraction: float = 1.0  # of the positions whose columns enter KFAC-expand's moment
    generator: torch.Generator | None = None  # for those positions
    inputs: list[Tensor] = field(default_factory=list)
    positions: int = 0
    totals: dict[str, Tensor] = field(default_factory=dict)
    grads: dict[str, Tensor] = field(default_factory=dict)  # draw-0 gradients from the capture
    direction: tuple[Tensor, Tensor] | None = None  # (u, v) of the weight's check

    def __post_init__(self) -> None:
        self.transposed = type(self.module) in TRANSPOSED
        self.groups = groups_of(self.module)
        self.moments = {k: Moment(self.mode) for k in ("rows", "cols")}
        self.moments["bias"] = Moment(self.bias_mode)
        # The bias's block is the output gradients' moment: the rows' own for Linear/Conv.
        self.bias_from_rows = not self.transposed and self.bias_mode == self.mode
        self.random = ["cols"] if self.transposed else []
        if not self.transposed and (self.weight is not None or self.bias_from_rows):
            self.random.append("rows")
        if self.bias is not None and not self.bias_from_rows:
            self.random.append("bias")

    def _collect(self, key: str, value: Tensor | None) -> None:
        if value is not None:
            old = self.totals.get(key)
            self.totals[key] = value if old is None else old.add_(value)

    def _grad(self, key: str, value: Tensor) -> None:
        old = self.grads.get(key)
        self.grads[key] = value if old is None else old.add_(value)

    def forward(self, x: Tensor) -> None:
        """A call on ``x``: the side that does not depend on the draws."""
        check_input(self.module, self.path, x, self.batch)
        self.inputs.append(x)
        if self.transposed:
            self.positions += math.prod(x.shape[2:])
            if self.weight is not None:
                self.moments["rows"].add(rows(self.module, x, x).unsqueeze(2))
            return
        cols = columns(self.module, self.path, x)
        self.positions += cols.positions
        if self.weight is not None and self.fraction == 1.0:
            self._add_columns(cols)  # else in after_forward, after the draws of z

    def _add_columns(self, cols: Columns) -> None:
        moment = self.moments["cols"]
        if self.mode == "reduce":  # only the sums over positions: no copy of the patches
            moment.add(cols.total())
        else:
            moment.add_gram(cols.gram(self.fraction, self.generator))

    def backward(self, call: int, g: Tensor, first: bool) -> None:
        """The gradient ``g`` at the output of call ``call`` in one draw."""
        x = self.inputs[call]
        r = rows(self.module, x, g)
        if self.transposed:
            if self.weight is not None:
                self._add_columns(columns(self.module, self.path, x, g))
        elif "rows" in self.random:
            self.moments["rows"].add(r.unsqueeze(2))
        if "bias" in self.random:
            self.moments["bias"].add(output_rows(self.module, g).unsqueeze(2))
        if first and self.weight is not None:
            self._project(x, g, r)
        if first and self.bias is not None:
            o = output_rows(self.module, g)
            self._grad("bias", torch.stack([o.sum((0, 1)), o.abs().sum((0, 1))]))

    def _project(self, x: Tensor, g: Tensor, r: Tensor) -> None:
        """``uᵀ (Σ_{n,t} r cᵀ) v`` for fixed random ``u``, ``v``: the check of the first draw.

        The weight gradient the factors stand for, in one random direction (the gradient itself
        would cost a copy of the patches); :func:`_check_layer` compares it with autograd's.
        """
        if self.direction is None:
            p = self.module.weight
            gen = torch.Generator(device=p.device).manual_seed(0)
            R, D = p.shape[0], p[0].numel()
            u = torch.randn(R, generator=gen, device=p.device, dtype=r.dtype)
            v = torch.randn(self.groups, D, generator=gen, device=p.device, dtype=r.dtype)
            self.direction = (u, v)
        u, v = self.direction
        ru = (r.unflatten(2, (self.groups, -1)) * u.reshape(self.groups, -1)).sum(-1)
        cv = projected_columns(self.module, self.path, x, g, v)
        terms = ru * cv
        self._grad("weight", torch.stack([terms.sum(), terms.abs().sum()]))

    def after_forward(self) -> None:
        """Close the moment that does not depend on the draws.

        With ``fraction < 1`` a convolution's or ``Linear``'s columns are sampled here, after
        the draws of ``z``, so that ``z`` (and with it ``G``) is what the same generator gives
        with every position.
        """
        if self.weight is not None and self.fraction < 1.0 and not self.transposed:
            for x in self.inputs:
                self._add_columns(columns(self.module, self.path, x))
        key = "rows" if self.transposed else "cols"
        self._collect(key, self.moments[key].take())

    def after_draw(self) -> None:
        """Close the moments of one draw (KFAC-reduce sums over all calls of the draw)."""
        for key in self.random:
            self._collect(key, self.moments[key].take())

    def entries(self, draws: int, N: int, like: Tensor) -> dict[str, list[Tensor]]:
        """The ``Kron`` entries of the weight and bias (normalised, see the module docs)."""
        out: dict[str, list[Tensor]] = {}
        T = self.positions  # per sample, over all calls
        if self.weight is not None:
            p = self.module.weight
            R, D = p.shape[0], p[0].numel()
            F0 = self._total("rows", R, like)
            F0 = F0 if self.transposed else F0 / draws
            scale = self.groups * N * (T if self.mode == "expand" else T * T)
            # in place: F_1 (up to [C_in·∏k]², large) is this layer's own sum
            F1 = self._total("cols", D, like).div_(scale * draws if self.transposed else scale)
            out[self.weight] = [F0, F1]
        if self.bias is not None:
            C = self.module.bias.shape[0]
            key = "rows" if self.bias_from_rows else "bias"
            out[self.bias] = [self._total(key, C, like) / draws]  # may share F0's total
        return out

    def _total(self, key: str, size: int, like: Tensor) -> Tensor:
        """The collected moment ``key``, or zeros ``[size, size]`` if nothing was collected."""
        total = self.totals.get(key)
        return like.new_zeros(size, size) if total is None else total


@dataclass
class _Replay:
    """A leaf module holding parameters outside KFAC layers, replayed per sample."""

    path: str
    module: nn.Module
    names: dict[str, str]  # local name -> model name
    batch: int
    ok: bool = True
    calls: list[tuple[Tensor, Tensor, int]] = field(default_factory=list)
    grads: dict[str, Tensor] = field(default_factory=dict)  # this draw's, per sample

    def forward(self, args: tuple, kwargs: dict, out: Any) -> bool:
        """Record a call; whether its output should be tapped."""
        x = args[0] if len(args) == 1 and isinstance(args[0], Tensor) else None
        if (
            kwargs
            or x is None
            or not isinstance(out, Tensor)
            or x.dim() == 0
            or out.dim() == 0
            or x.shape[0] != self.batch
            or out.shape[0] != self.batch
        ):
            self.ok = False
            return False
        y = out.detach()
        self.calls.append((x.detach(), y, y._version))
        return True

    def backward(self, call: int, g: Tensor) -> None:
        """Per-sample gradients of this call, added to the draw's."""
        if not self.ok:
            return
        x, y, version = self.calls[call]
        params = {local: getattr(self.module, local).detach() for local in self.names}

        def one(x_n: Tensor, g_n: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            def f(p: dict[str, Tensor]) -> Tensor:
                return functional_call(self.module, p, (x_n.unsqueeze(0),)).squeeze(0)

            out, pull = vjp(f, params)
            return out, pull(g_n)[0]

        try:
            with torch.enable_grad():
                outs, grads = vmap(one)(x, g.detach())
        except RuntimeError:  # an operation vmap cannot batch: the batch gradient serves
            self.ok = False
            return
        tol = _tolerance(y.dtype)
        if y._version == version and not torch.allclose(
            outs, y, rtol=tol, atol=tol * float(y.abs().max())
        ):
            self.ok = False  # the module does not treat the samples independently
            return
        for local, name in self.names.items():
            old = self.grads.get(name)
            self.grads[name] = grads[local] if old is None else old.add_(grads[local])

    def take(self, name: str, batch_grad: Tensor | None) -> Tensor | None:
        """This draw's per-sample gradients of ``name`` if they sum to the batch gradient."""
        per_sample = self.grads.pop(name, None)
        if not self.ok or per_sample is None or batch_grad is None:
            return None
        tol = _tolerance(batch_grad.dtype)
        bound = (
            tol * (per_sample.abs().sum(0) + batch_grad.abs()) + torch.finfo(batch_grad.dtype).tiny
        )
        if bool(((per_sample.sum(0) - batch_grad).abs() > bound).any()):
            self.ok = False  # the parameter is also used outside the module's calls
            return None
        return per_sample


def _noise(
    f: Tensor, mc_samples: int | str, generator: torch.Generator | None, noise: Tensor | None
) -> Tensor:
    """``z`` ``[S, *f.shape]``: given, Rademacher, or the scaled unit vectors (``"exact"``)."""
    if noise is not None:
        if noise.dim() != f.dim() + 1 or noise.shape[1:] != f.shape:
            raise ValueError(
                f"noise must have shape [S, {', '.join(map(str, f.shape))}] for logits of shape "
                f"{tuple(f.shape)}; got {tuple(noise.shape)}"
            )
        return noise.to(f)
    if mc_samples == "exact":
        K = f.numel()
        if K * K > 1 << 26:
            raise ValueError(
                f"mc_samples='exact' takes one backward pass per logit entry and holds "
                f"{K}² vectors entries for logits of shape {tuple(f.shape)}; use an integer "
                "mc_samples (the Monte-Carlo estimate is unbiased) or a smaller batch"
            )
        eye = torch.eye(K, dtype=f.dtype, device=f.device) * math.sqrt(K)
        return eye.reshape(K, *f.shape)
    # Held at once: the draws z and the vectors s = B z, [S, *logits.shape] each.
    check_sample_memory(
        "mc_samples",
        mc_samples,
        2 * f.numel(),
        f,
        "use a smaller mc_samples (the estimate is unbiased for any), or a smaller batch",
    )
    z = torch.randint(0, 2, (mc_samples, *f.shape), generator=generator, device=f.device)
    return z.to(f.dtype) * 2 - 1


def check_kron_options(mode: Any, fraction: Any, prefix: str = "") -> None:
    """Refuse a KFAC ``mode`` other than expand/reduce, and a bad ``position_fraction``.

    Args:
        mode: :func:`kron_curvature`'s ``mode``.
        fraction: Its ``position_fraction``: in ``(0, 1]``, and 1 with ``mode="reduce"``.
        prefix: Put before the names in the messages (``"kron_"``: ``DiagBackprop``'s).

    Raises:
        ValueError: Naming the argument, the value and what to do.
    """
    if mode not in ("expand", "reduce"):
        raise ValueError(f"{prefix}mode must be 'expand' or 'reduce', got {mode!r}")
    name = f"{prefix}position_fraction"
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"{name} must be a number in (0, 1], got {fraction!r}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {fraction!r}")
    if mode == "reduce" and fraction != 1.0:
        raise ValueError(
            f"{name}={fraction!r} samples the positions of KFAC-expand's patch factor; "
            "KFAC-reduce only sums the patches (about a forward pass's cost): leave "
            f"{name} at 1 with the 'reduce' mode"
        )


def _check_args(
    mode: str, mc_samples: Any, full_limit: Any, N: Any, batch: int, fraction: Any
) -> None:
    check_kron_options(mode, fraction)
    if mc_samples != "exact" and (
        isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1
    ):
        raise ValueError(f"mc_samples must be a positive int or 'exact', got {mc_samples!r}")
    if isinstance(full_limit, bool) or not isinstance(full_limit, int) or full_limit < 0:
        raise ValueError(f"full_limit must be a non-negative int, got {full_limit!r}")
    if N is not None and (isinstance(N, bool) or not isinstance(N, int) or batch > N):
        raise ValueError(
            f"N is the number of samples in the data set, at least the batch's {batch}; got {N!r}"
        )


def _plan(
    model: nn.Module, names: dict[int, str], mode: Mode, bias_mode: Mode, batch: int
) -> tuple[list[_Layer], dict[int, list[tuple[str, nn.Module, str]]]]:
    """KFAC layers, and every parameter's holders ``(module path, module, local name)``."""
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for local, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((path, module, local))
    layers = []
    seen.clear()
    for path, module in model.named_modules():
        if type(module) not in KFAC_TYPES:
            continue
        own = dict(module.named_parameters(recurse=False))

        def kfac(local: str, own: dict = own) -> str | None:
            p = own.get(local)
            if p is None or id(p) not in names or len(holders[id(p)]) != 1:
                return None
            return names[id(p)]

        weight, bias = kfac("weight"), kfac("bias")
        if weight is not None or bias is not None:
            layers.append(_Layer(path, module, weight, bias, mode, bias_mode, batch))
    return layers, holders


def kron_curvature(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    N: int | None = None,
    mode: Mode = "expand",
    bias_block: Literal["exact", "kfac"] = "exact",
    mc_samples: int | Literal["exact"] = 1,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    full_limit: int = 512,
    position_fraction: float = 1.0,
) -> KronResult:
    """KFAC GGN of ``model`` on one batch, as laplace-torch's ``Kron`` (module documentation).

    Args:
        model: Any network whose forward pass treats the samples along dim 0 independently.
            Every trainable parameter (``requires_grad``) gets a block, in
            ``model.parameters()`` order (laplace-torch's ``self.params``).
        inputs: ``[M, *]``, the batch.
        targets: As ``loss`` takes them.
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a torch loss module;
            the GGN is that of this loss (laplace-torch's convention: ``reduction="sum"``,
            regression ``½ Σ (f − y)²``).
        N: The data set size (laplace-torch's ``N``): the second factor of each Kronecker pair
            is the batch mean times ``M/N``. ``None``: ``M`` (the batch mean).
        mode: ``"expand"`` or ``"reduce"`` (Eschenhagen et al., 2023).
        bias_block: The block of a KFAC layer's bias: ``"exact"``, the per-sample moment
            ``Σ_n (Σ_t g)(Σ_t g)ᵀ`` of the output gradients (the bias's GGN block in
            expectation); ``"kfac"``, the weight's output-gradient factor ``G`` (laplace-torch +
            curvlinops; the same for ``mode="reduce"``).
        mc_samples: Draws ``S`` of ``z``; ``"exact"``: the expectation, one backward pass per
            logit entry (tiny outputs only).
        generator: For the draws.
        noise: ``[S, *logits.shape]``, replaces the draws ``z`` (``E[z zᵀ] = I`` keeps the
            estimate unbiased).
        full_limit: Parameters outside KFAC layers with at most this many entries get a full
            block (1-D) or the nearest Kronecker product of their full block (≥ 2-D); larger ones
            a diagonal (1-D) or Kronecker-factored gradient moments (≥ 2-D).
        position_fraction: KFAC-expand only: the fraction of each sample's weight-sharing
            positions, per call, whose column vectors enter the column factor ``F_1`` (a
            convolution's or a token-wise ``Linear``'s ``A``, from input patches; a transposed
            convolution's output-gradient patches), drawn uniformly without replacement with
            ``generator`` after the draws of ``z`` and weighted by ``T/T'``: an unbiased
            estimate of the full factor at about ``position_fraction`` times its cost, which is
            ``D / C_out`` times the layer's forward pass (``D = C_in · ∏k``) and most of
            KFAC-expand's. ``F_0`` (``G``), the biases and the other blocks are unchanged (the
            same as with every position for the same ``generator``). 1 (default): every
            position, no sampling.

    Returns:
        :class:`KronResult`; ``(result.loss, result.kron)`` is what laplace-torch's
        ``CurvatureInterface.kron(x, y, N)`` returns.

    Raises:
        ValueError: For bad arguments (``position_fraction < 1`` with ``mode="reduce"``
            included), a KFAC layer called without the batch on dim 0 of a
            batched input, a KFAC layer whose weight gradient is not what its calls give (the
            weight is also used elsewhere), non-finite logits, and bad targets (from ``loss``).
        TypeError: For inputs or outputs that are not tensors.
    """
    if not isinstance(inputs, Tensor) or inputs.dim() == 0:
        raise TypeError(f"inputs must be a batched tensor [M, *], got {type(inputs).__name__}")
    batch = inputs.shape[0]
    _check_args(mode, mc_samples, full_limit, N, batch, position_fraction)
    if bias_block not in ("exact", "kfac"):
        raise ValueError(f"bias_block must be 'exact' or 'kfac', got {bias_block!r}")
    loss_fn = as_loss(loss)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    names = {id(p): n for n, p in named}
    bias_mode: Mode = "reduce" if bias_block == "exact" else mode
    layers, holders = _plan(model, names, mode, bias_mode, batch)
    for layer in layers:
        layer.fraction, layer.generator = float(position_fraction), generator
    in_layers = {n for layer in layers for n in (layer.weight, layer.bias) if n is not None}
    replays: dict[int, _Replay] = {}
    for n, p in named:
        if n in in_layers or len(holders[id(p)]) != 1:
            continue
        path, module, local = holders[id(p)][0]
        if next(module.children(), None) is None:
            replay = replays.setdefault(id(module), _Replay(path, module, {}, batch))
            replay.names[local] = n

    taps: list[Any] = []
    state = {"first": True}

    def layer_hook(layer: _Layer):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            extra = set(kwargs) - ({"output_size"} if layer.transposed else set())
            if len(args) != 1 or not isinstance(args[0], Tensor) or extra:
                raise ValueError(
                    f"{describe(module, layer.path)} was called with {len(args)} positional "
                    f"arguments and keywords {sorted(kwargs)}; KFAC needs one input tensor"
                )
            if not isinstance(out, Tensor):
                raise TypeError(f"{describe(module, layer.path)} returned {type(out).__name__}")
            layer.forward(args[0].detach())
            call = len(layer.inputs) - 1
            return tap_output(out, lambda g: layer.backward(call, g, state["first"]))

        return hook

    def replay_hook(replay: _Replay):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            if not replay.forward(args, kwargs, out):
                return None
            call = len(replay.calls) - 1
            return tap_output(out, lambda g: replay.backward(call, g))

        return hook

    def tap_output(out: Tensor, fn: Any) -> Tensor | None:
        if not out.requires_grad:
            return None
        # A view loses its hooks when an in-place operation follows: tap a copy instead.
        tapped = out.clone() if out._is_view() else out
        taps.append(tapped.register_hook(lambda g: fn(g.detach())))
        return tapped if tapped is not out else None

    handles = []
    try:
        for layer in layers:
            hook = layer_hook(layer)
            handles.append(layer.module.register_forward_hook(hook, with_kwargs=True, prepend=True))
        for replay in replays.values():
            handles.append(
                replay.module.register_forward_hook(
                    replay_hook(replay), with_kwargs=True, prepend=True
                )
            )
        try:
            with torch.enable_grad():
                logits = model(inputs)
        finally:
            for handle in handles:
                handle.remove()
        if not isinstance(logits, Tensor):
            raise TypeError(f"the model returned {type(logits).__name__}; KFAC needs one tensor")
        f = logits.detach()
        if not bool(torch.isfinite(f).all()):
            raise ValueError(
                f"the logits have {int((~torch.isfinite(f)).sum())} non-finite entries (NaN or "
                "inf): check the inputs and the weights"
            )
        value = loss_fn.value(f, targets).detach()
        z = _noise(f, mc_samples, generator, noise)
        vectors = loss_fn.hessian_sqrt(f, targets, z)
        called = [layer for layer in layers if layer.inputs]
        for layer in layers:
            if not layer.inputs:  # never called (e.g. an attention's out_proj): no KFAC
                for n in (layer.weight, layer.bias):
                    if n is not None:
                        in_layers.discard(n)
        for layer in called:
            layer.after_forward()
        params = [p for _, p in named]
        blocks = {
            n: OtherBlock(p.shape, kind_of(p.shape, full_limit))
            for n, p in named
            if n not in in_layers
        }
        paths = dict.fromkeys(in_layers, "layer")
        by_name = dict(named)
        S = vectors.shape[0]
        for k in range(S):
            state["first"] = k == 0
            grads = torch.autograd.grad(
                logits, params, vectors[k], retain_graph=k < S - 1, allow_unused=True
            )
            batch_grads = {n: g for (n, _), g in zip(named, grads, strict=True)}
            for layer in called:
                layer.after_draw()
                if k == 0:
                    _check_layer(layer, batch_grads)
            for n, block in blocks.items():
                g = batch_grads[n]
                holder = holders[id(by_name[n])]
                replay = replays.get(id(holder[0][1])) if len(holder) == 1 else None
                per_sample = replay.take(n, g) if replay is not None else None
                if per_sample is not None:
                    block.add(per_sample)
                    paths.setdefault(n, "per-sample")
                elif g is not None:
                    block.add(g.unsqueeze(0))
                    paths[n] = "batch gradient"
                else:
                    paths.setdefault(n, "unused")  # no gradient: a zero block
    finally:
        for tap in taps:
            tap.remove()
    del logits
    N_data = batch if N is None else N
    entries: dict[str, list[Tensor]] = {}
    for layer in called:
        entries.update(layer.entries(S, N_data, f))
    for n, block in blocks.items():
        entries[n] = block.factors(S, batch / N_data, f)
    kinds = {n: b.kind for n, b in blocks.items()}
    for layer in called:
        if layer.weight is not None:
            kinds[layer.weight] = "kfac"
        if layer.bias is not None:
            kinds[layer.bias] = "kfac bias"
    order = [n for n, _ in named]
    kron = Kron([entries[n] for n in order])
    return KronResult(
        loss=value,
        kron=kron,
        names=order,
        blocks={n: kinds[n] for n in order},
        paths={n: paths[n] for n in order},
        logits=f,
    )


def _check_layer(layer: _Layer, batch_grads: dict[str, Tensor | None]) -> None:
    """The capture's weight and bias gradients must be the batch's (first draw).

    The bias's entry by entry, with the rounding bound ``√ε · Σ_{n,t} |g|``; the weight's in the
    random direction ``u vᵀ`` of :meth:`_Layer._project` (for a discrepancy ``δ`` the two differ
    by ``uᵀ δ v``, almost surely not 0), with the rounding bound ``√ε · Σ |u·r| |c·v|``.
    """
    for key, name in (("weight", layer.weight), ("bias", layer.bias)):
        if name is None:
            continue
        captured, actual = layer.grads.pop(key, None), batch_grads[name]
        if captured is None and actual is None:
            continue
        p = getattr(layer.module, key)
        tol = _tolerance(p.dtype)
        actual = torch.zeros_like(p) if actual is None else actual
        if key == "weight":
            if layer.direction is None:  # no gradient arrived at any call
                continue
            u, v = layer.direction
            G = actual.reshape(layer.groups, p.shape[0] // layer.groups, -1)
            projected = float(((G * v.unsqueeze(1)).sum(-1).flatten() * u).sum())
            got, bound = (0.0, 0.0) if captured is None else map(float, captured)
            wrong = abs(got - projected) > tol * (bound + abs(projected))
        else:  # elementwise, against the sum of the terms' magnitudes (a bias before a norm
            # layer has a gradient of rounding size only)
            total, bound = (0, 0) if captured is None else captured
            tiny = torch.finfo(p.dtype).tiny
            wrong = bool(((total - actual).abs() > tol * (bound + actual.abs()) + tiny).any())
        if wrong:
            raise ValueError(
                f"{describe(layer.module, layer.path)}: the gradient of its {key} is not what "
                "its calls give (the parameter is also used outside this module's calls, or "
                "the module computes something other than its class's forward); KFAC cannot "
                "factor it. Give it its own parameter, or freeze it (requires_grad=False)"
            )
