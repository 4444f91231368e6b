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
Where that capture cannot serve a parameter (held by a module with submodules, such as MONAI
UNETR's position embeddings or SwinUNETR's relative-position bias tables; a ``weight_norm`` or
other parametrization; a leaf called on windows folded into dim 0 or on several inputs; a
parameter used outside its module), the smallest enclosing module that is called on the batch
is replayed whole per sample, or else the whole model (``vmap`` over the batch of ``vjp`` of
``functional_call``, the vectors ``s`` as output cotangents, chunked over the batch). The
estimate and its expectation are the same on every path; the result's ``mc_paths`` names the
path per parameter. So Monte Carlo runs on any network whose forward treats the samples
independently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lsn_ext._fingerprint import fingerprint, global_forward_hooks
from lsn_ext._functional import functional_call_all
from lsn_ext._kernels import choose, timing_applies
from lsn_ext._memory import check_sample_memory
from lsn_ext.engine import (
    DiagBackpropResult,
    ModeAside,
    all_modules,
    bind_arguments,
    check_finite_logits,
    check_finite_result,
    check_inputs,
    check_logits,
    diag_backprop,
    is_parametrized,
    round_off,
    select_params,
    sum_tolerance,
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
            ``"db_calibrated"``); ``"mc"`` runs on any model whose forward treats the samples
            of the batch independently (transformer U-Nets, parametrizations and instance-level
            ``forward`` overrides included; see ``mc_paths`` of the result for how each
            parameter's per-sample gradients were taken).
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
        ValueError: An unknown estimator, ``mc_samples < 1`` or more draws than the device's
            memory holds (naming the memory they need), ``shrinkage`` outside
            ``[0, 1]``, non-finite weights (naming the parameter) or inputs, an empty batch,
            bad targets, or anything :func:`~lsn_ext.diag_backprop` refuses.
        NotImplementedError: For ``"mc"``, a forward that mixes the samples (naming the module,
            the block or the model whose output or input depends on other samples), a replay
            that torch cannot run per sample, or dropout in training mode in ``forward``
            (``F.dropout(x, training=True)``). A parameter tied across modules is supported: its
            per-sample gradients from all modules and calls are summed before squaring.
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
    return DiagBackpropResult(db.loss, db.logits, diagonals, scales, mc.mc_paths)


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


_CONV_DIMS: dict[type[nn.Module], int] = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_CONV_T_DIMS: dict[type[nn.Module], int] = {
    nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3
}  # fmt: skip
_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d,
    nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm,
)  # fmt: skip


def _direct_sample_grads(
    module: nn.Module, names: dict[str, str], x: Tensor, g: Tensor, squared: bool = False
) -> dict[str, Tensor] | None:
    """Per-sample gradients of a plain convolution, ``nn.Linear`` or norm layer without replay.

    The weight gradient of one sample needs only its input and output gradient: for a
    convolution (or transposed convolution) ``aten.convolution_backward`` with only the weight
    (and bias) outputs, grouped over the samples or one call per sample
    (:func:`_conv_sample_grads`; what ``vmap`` of the kernel computes, without its per-call
    overhead); for ``nn.Linear`` ``g_nᵀ x_n`` summed over the
    other axes; for a norm layer (:func:`_norm_sample_grads`) ``Σ g_n · x̂_n`` and ``Σ g_n``.
    The replay of :meth:`_Owner.sample_grads` also runs the module's forward again; these do
    not. ``None`` for any other module (subclasses included), a module whose ``forward`` was
    replaced on the instance, a convolution with another padding mode or a padding string, and
    where the convolution's kernel fails (the caller then replays the module).

    With ``squared``, the sums of their squares over the samples, ``Σ_n (J_nᵀ g_n)²``.

    Returns:
        ``{own name: [N, *shape]}`` for the names in ``names`` (``{own name: shape}`` with
        ``squared``), or ``None``.
    """
    if "forward" in vars(module):  # a forward replaced on the instance: replay that one
        return None
    want_w, want_b = "weight" in names, "bias" in names
    if type(module) is nn.Linear:
        out: dict[str, Tensor] = {}
        if want_w:
            out["weight"] = torch.einsum("n...o,n...i->noi", g, x)
        if want_b:
            out["bias"] = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        return {k: _square_sum(v) for k, v in out.items()} if squared else out
    if type(module) in _NORMS:
        out = _norm_sample_grads(module, want_w, want_b, x, g)
        if out is None or not squared:
            return out
        return {k: _square_sum(v) for k, v in out.items()}
    transposed = type(module) in _CONV_T_DIMS
    dims = (_CONV_T_DIMS if transposed else _CONV_DIMS).get(type(module))
    if dims is None or module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    if not (want_w or want_b):
        return {}
    w = module.weight.detach()
    out_padding = [0] * dims
    if transposed:  # as the call made it (``output_size`` may have set it): from the shapes
        for i in range(dims):
            size = (x.shape[2 + i] - 1) * module.stride[i] - 2 * module.padding[i]
            out_padding[i] = g.shape[2 + i] - size - module.dilation[i] * (w.shape[2 + i] - 1) - 1
    bias = None
    if module.bias is not None:
        bias = [w.shape[1] * module.groups if transposed else w.shape[0]]
    conv = (module.stride, module.padding, module.dilation, transposed, out_padding)
    try:
        gw, gb = _conv_sample_grads(g.contiguous(), x.contiguous(), w, bias, conv, module.groups,
                                    [False, want_w, want_b], squared)  # fmt: skip
    except RuntimeError:  # a kernel's limit on this convolution: replay the module instead
        return None
    grads: dict[str, Tensor] = {}
    if want_w:
        grads["weight"] = gw
    if want_b:
        grads["bias"] = gb
    return grads


_LOOP_FASTER: dict[tuple, bool] = {}
"""Per CPU convolution signature: whether per-sample kernels beat the grouped one (timed once).

Keyed by shapes, convolution geometry, dtype and thread count, never by a model: both kernels
compute the same per-sample gradients exactly (up to round-off), so an entry that no longer
fits the machine's load changes the speed only, never a result.
"""


def _conv_sample_grads(
    g: Tensor,
    x: Tensor,
    w: Tensor,
    bias: list[int] | None,
    conv: tuple,
    groups: int,
    mask: list[bool],
    squared: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Per-sample weight and bias gradients of a convolution, ``[N, *w.shape]`` and ``[N, C]``.

    Two exact ways to one result: one ``aten.convolution_backward`` with the samples folded into
    the channels as ``N · groups`` groups (input ``[1, N·C_in, *S]``, output gradient
    ``[1, N·C_out, *S']``; the weight's values do not enter its gradient, so one zero expanded
    to the grouped weight's shape stands in for the weight repeated ``N`` times), or ``N`` calls
    on one sample each. The grouped kernel is one call, but oneDNN's CPU kernels for it are
    several times slower than ``N`` plain ones at some shapes (measured on a quiet machine:
    4.5 ms against 0.75 ms for 128 → 128 channels at 4², batch 8, one thread). On CPU, the first
    call of each signature (shapes, convolution arguments, dtype, threads) times both and keeps
    the faster (:func:`lsn_ext._kernels.choose`); on other devices, and under
    ``torch.use_deterministic_algorithms(True)``, the grouped kernel serves.

    Args:
        g: Output gradient ``[N, C_out, *S']``, contiguous.
        x: Input ``[N, C_in, *S]``, contiguous.
        w: The weight (only its shape is used).
        bias: ``[C_out]`` (the bias's size) or ``None`` without a bias.
        conv: ``(stride, padding, dilation, transposed, output_padding)``.
        groups: The convolution's groups.
        mask: ``convolution_backward``'s output mask (input, weight, bias).
        squared: Return ``Σ_n`` of their squares instead, ``w.shape`` and ``[C]`` (the loop over
            samples then accumulates the squares and keeps no ``[N, *w.shape]`` tensor).
    """
    n = x.shape[0]
    stride, padding, dilation, transposed, out_padding = conv
    shapes = [w.shape] + ([torch.Size(bias)] if bias is not None else [])

    def grouped() -> tuple[Tensor | None, Tensor | None]:
        _, gw, gb = torch.ops.aten.convolution_backward(
            g.reshape(1, -1, *g.shape[2:]), x.reshape(1, -1, *x.shape[2:]),
            w.new_zeros(()).expand(n * w.shape[0], *w.shape[1:]),
            None if bias is None else [n * bias[0]],
            stride, padding, dilation, transposed, out_padding, n * groups, mask,
        )  # fmt: skip
        grads = (gw.view(n, *w.shape) if mask[1] else None, gb.view(n, -1) if mask[2] else None)
        return tuple(_square_sum(t) if squared and t is not None else t for t in grads)

    def per_sample() -> tuple[Tensor | None, Tensor | None]:
        # The weight itself (contiguous): CPU kernels copy a stand-in expanded zero per call.
        args = (bias, stride, padding, dilation, transposed, out_padding, groups, mask)
        # Squared, a large gradient is accumulated sample by sample as _square_sum would (the
        # same numbers as squaring the stacked gradients), without the stack.
        running = [
            squared and k < len(shapes) and _square_sum_loops(n, shapes[k], x.device)
            for k in (0, 1)
        ]
        parts: list[list[Tensor]] = [[], []]
        sums: list[Tensor | None] = [None, None]
        for i in range(n):
            grads = torch.ops.aten.convolution_backward(g[i : i + 1], x[i : i + 1], w, *args)[1:]
            for k, t in enumerate(grads):
                if not mask[k + 1]:
                    continue
                if not running[k]:
                    parts[k].append(t)
                else:  # a new tensor per sample: squared in place
                    sums[k] = t.square_() if sums[k] is None else sums[k].addcmul_(t, t)
        out = [sums[k] if running[k] else torch.stack(parts[k]) if mask[k + 1] else None
               for k in (0, 1)]  # fmt: skip
        return tuple(_square_sum(t) if squared and t is not None and not running[k] else t
                     for k, t in enumerate(out))  # fmt: skip

    if n == 1 or not timing_applies(x):
        return grouped()
    key = (
        x.shape, g.shape, w.shape, bias is None, *map(tuple, (stride, padding, dilation)),
        transposed, tuple(out_padding), groups, tuple(mask), x.dtype, torch.get_num_threads(),
    )  # fmt: skip
    return per_sample() if choose(_LOOP_FASTER, key, per_sample, grouped) else grouped()


def _norm_sample_grads(
    module: nn.Module, want_w: bool, want_b: bool, x: Tensor, g: Tensor
) -> dict[str, Tensor] | None:
    """Per-sample ``γ`` and ``β`` gradients of a norm layer: ``Σ g_n · x̂_n`` and ``Σ g_n``.

    ``y = γ x̂ + β`` with ``x̂`` from the rule (:meth:`standardised`: running or per-group
    statistics), summed per sample over the entries each parameter scales: dims ``2, …`` for
    the per-channel ``γ``, ``β`` of batch, instance and group norm (``x`` ``[N, C, *]``), the
    leading dims but the first for layer norm's ``normalized_shape``. ``None`` where the
    samples are not independent (batch statistics) or ``x`` has no batch dim.
    """
    rule = RULES[type(module)]
    try:
        rule.check(module)  # batch statistics, or running statistics a call would update
    except ValueError:
        return None
    instance = isinstance(module, nn.modules.instancenorm._InstanceNorm)
    if instance and x.dim() == module._get_no_batch_dim():
        return None
    if isinstance(module, nn.LayerNorm):
        if x.dim() <= len(module.normalized_shape):
            return None
        dims = tuple(range(1, x.dim() - len(module.normalized_shape)))
    else:
        dims = tuple(range(2, x.dim()))

    def total(t: Tensor) -> Tensor:
        return t.sum(dims) if dims else t

    grads: dict[str, Tensor] = {}
    if want_w:
        grads["weight"] = total(g * rule.standardised(module, x))
    if want_b:  # without summed dims this is g itself: a copy, as the caller squares in place
        grads["bias"] = _own(total(g), g)
    return grads


# Modules that torch refuses to run on a batch of one in some shapes although they treat samples
# independently (GroupNorm over one value per group: "Expected more than 1 value per channel").
# Their per-sample replay runs the sample next to a copy of itself with a zero cotangent.
_PAIRED_REPLAY: tuple[type[nn.Module], ...] = (nn.GroupNorm,)

# A block or the whole model replayed per sample (torch.func) runs on chunks of samples whose
# per-sample gradients hold at most about this many numbers (at least one sample per chunk).
_REPLAY_NUMBERS = 2**24

# How the per-sample gradients of a parameter were taken (``DiagBackpropResult.mc_paths``).
_BY_MODULE, _BY_MODEL = "module", "model"


class _Owner:
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
        self.direct = not block  # try _direct_sample_grads
        self.calls = 0
        self.partial: dict[str, Tensor] | None = None
        self.squares: dict[str, Tensor] | None = None  # this draw's Σ_n of squares (alone)
        self.alone = False  # whether sample_squares may serve (set per call by _run)

    @functools.cached_property
    def bare(self) -> _Bare:
        """The module without its hooks, for the replays.

        Built on first use: most owners of a plain network never replay, and an ``nn.Module``
        per owner and call costs.
        """
        return _Bare(self.module)

    def sample_grads(self, x: Tensor, g: Tensor, out: Tensor | None = None) -> dict[str, Tensor]:
        """``J_nᵀ g_n`` w.r.t. this module's parameters, per sample: ``{name: [N, *shape]}``.

        Plain convolutions and ``nn.Linear`` take their weight gradients directly
        (:func:`_direct_sample_grads`); other modules are replayed per sample, and the replayed
        outputs must equal ``out``, the module's output in the batched forward pass (where
        given: a module whose forward depends on the batch without a gradient path, such as a
        branch on ``x.mean()``, fails here instead of giving a wrong estimate).
        """
        if self.direct:
            direct = _direct_sample_grads(self.module, self.names, x, g)
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
        return {k[2:]: _own(v, x, g) for k, v in grads.items()}

    def sample_squares(self, x: Tensor, g: Tensor, out: Tensor | None = None) -> dict[str, Tensor]:
        """``Σ_n (J_nᵀ g_n)²`` w.r.t. this module's parameters: ``{name: shape}``.

        A leaf's share of one draw where nothing else adds to its per-sample gradients (see
        :func:`_run`): the direct kernels accumulate the squares without keeping
        ``[N, *shape]`` (:func:`_conv_sample_grads`).
        """
        if self.direct:
            direct = _direct_sample_grads(self.module, self.names, x, g, squared=True)
            if direct is not None:
                return direct
            self.direct = False
        return {k: _square_sum(v) for k, v in self.sample_grads(x, g, out).items()}

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
        return {k[2:]: _own(v, x, g) for k, v in grads.items()}

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
        return f"block '{self.path}'" if self.block else _BY_MODULE


def _unchanged(t: Tensor, version: int) -> Tensor | None:
    """``t`` where no in-place operation changed it since its version was ``version``."""
    return t if t._version == version else None


def _own(t: Tensor, *inputs: Tensor) -> Tensor:
    """``t``, or a copy where it shares memory with one of ``inputs``.

    Per-sample gradients are squared in place (:func:`_run`), so each must own its memory: a
    replay's gradient can be its input itself (``vjp`` of ``x + b`` gives ``g`` for ``b``), and
    the output gradient ``g`` can be the Monte-Carlo vectors or be shared with other modules.
    """
    ptr = t.untyped_storage().data_ptr()
    if any(ptr == i.untyped_storage().data_ptr() for i in inputs):
        return t.clone()
    return t


_SQUARE_SUM_LOOP = 2**14
"""Entries per sample from which :func:`_square_sum` accumulates sample by sample."""


def _square_sum_loops(n: int, shape: torch.Size, device: torch.device) -> bool:
    """Whether :func:`_square_sum` accumulates sample by sample for ``[n, *shape]``.

    On CPU only: a GPU reads memory fast enough, and ``n`` kernel launches would cost more.
    """
    return device.type == "cpu" and n > 1 and shape.numel() >= _SQUARE_SUM_LOOP


def _square_sum(t: Tensor) -> Tensor:
    """``Σ_n t_n²`` over dim 0 of ``t`` (``[N, *shape]`` → ``shape``), squaring ``t`` in place.

    For large per-sample entries, ``t_0² + Σ_n t_n · t_n`` one sample at a time (the running sum
    stays in cache; ``square_().sum(0)`` runs over ``t`` twice, and a sum over the outer dim is
    several times slower than the accumulation for ``[8, 64, 192, 3, 3]``), on CPU. Every caller
    squares this way, so that a call that accumulates without stacking gives the same numbers.
    """
    if _square_sum_loops(t.shape[0], t.shape[1:], t.device):
        total = t[0].square()
        for t_n in t[1:]:
            total.addcmul_(t_n, t_n)
        return total
    return t.square_().sum(0)


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


def _gather(
    owners: list[_Owner], total_grads: dict[str, Tensor | None]
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
    where: dict[str, list[_Owner]] = {}
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


def _gather_squares(owners: list[_Owner]) -> dict[str, Tensor]:
    """One draw's ``Σ_n (J_nᵀ s_n)²`` from the owners that squared their own share."""
    squares: dict[str, Tensor] = {}
    for owner in owners:
        if owner.squares is not None:
            squares.update({name: owner.squares[own] for own, name in owner.names.items()})
        owner.squares = None
    return squares


def _lost(model: nn.Module, name: str, owners: list[_Owner], what: str) -> None:
    modules = " and ".join(o.describe() for o in owners if name in o.names.values())
    raise RuntimeError(
        f"the Monte-Carlo estimator lost the per-sample gradients of '{name}' in "
        f"{modules or _describe(model, model)}: {what}, although the parameter reaches the "
        "output and its capture worked in the first draw. Something after the module bypasses "
        "the output it returned (an in-place operation on it?). Write that operation out of "
        "place, or use estimator='db'"
    )


class _RandomOpGuard(TorchFunctionMode):
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


class _ReplanError(Exception):
    """Raised inside the forward pass when a leaf's capture cannot serve: plan blocks first."""


class _UnverifiedError(Exception):
    """A call without batch weight gradients captured other than the verified call did.

    Other parameters, or the same ones through other module calls (:class:`_Verified`). That
    call structure goes back to verified calls for good, or, where the call ended its backward
    pass at the entry modules' outputs (``at_entries``), to passes that end at the input.
    Carries the call's random vectors ``z``, so that the rerun draws nothing new.
    """

    def __init__(self, noise: Tensor, structure: tuple, verified: _Verified, at_entries: bool):
        super().__init__()
        self.noise = noise
        self.structure = structure
        self.verified = verified
        self.at_entries = at_entries


@dataclass(frozen=True)
class _Verified:
    """What a verified call (batch weight gradients checked) found for one call structure.

    Kept per model, per key of :func:`_monte_carlo` (input signature and the model's
    :func:`~lsn_ext._fingerprint.fingerprint`) and per *structure* (the module calls of the
    forward pass whose output needs a gradient, in order, each with whether it was called on
    the input itself, and how often each parameter entered a torch function): a later call
    uses it only where all three are equal, and checks every
    draw that its backward pass reached exactly ``fired``.

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


def _monte_carlo(
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
    replan = _force is not None or signature in _REPLAN.get(model, set())
    # Global forward hooks run before the capture's and may change any output on any call.
    fast = _force is None and not global_forward_hooks()
    plans = _plans(model, (signature, state)) if fast else None
    while True:
        owners, whole = _plan(model, names, chosen, args, replan, _force)
        try:
            result, structure, found = _run(
                model, args, targets, loss_fn, mc_samples, generator, noise, names, chosen,
                owners, whole, plans, state,
            )  # fmt: skip
        except _ReplanError:
            if replan:
                raise
            _REPLAN.setdefault(model, set()).add(signature)
            if plans is not None:
                plans.clear()
            replan = True
            continue
        except RuntimeError as err:
            explained = _explained(err)
            if explained is None:
                raise
            raise explained from err
        except _UnverifiedError as err:
            # Verified calls from now on, or passes to the input where the entries missed one.
            plans[err.structure] = (
                dataclasses.replace(err.verified, entries=False) if err.at_entries else None
            )
            noise = err.noise
            continue
        if plans is not None and found is not None and structure not in plans:
            _keep(plans, structure, found)
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


# What the Monte-Carlo estimator caches between calls, and why a stale entry cannot change a
# result:
# - _VERIFIED: per model, per (input signature, fingerprint of the model) and per call
#   structure, what a verified call found (_Verified; None: verify every call). A later call
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
# - _LOOP_FASTER (rules of the direct kernels) and the conv rule's _SPLIT_FASTER: which of two
#   exact formulations of the same product is faster for a shape signature. Both compute the
#   same numbers up to round-off, so a stale choice changes the speed only.
_REPLAN: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, dict[tuple, _Verified | None]]] = (
    weakref.WeakKeyDictionary()
)
_KEEP = 8
"""Keys per model, and call structures per key, that :data:`_VERIFIED` keeps (most recent)."""


def _plans(model: nn.Module, key: tuple) -> dict[tuple, _Verified | None]:
    """The verified plans of ``model`` for ``key``, per call structure (most recent kept)."""
    known = _VERIFIED.setdefault(model, {})
    plans = known.pop(key, {})
    _keep(known, key, plans)
    return plans


def _keep(cache: dict, key: Any, value: Any) -> None:
    """``cache[key] = value`` as the most recent entry, dropping the oldest beyond :data:`_KEEP`."""
    cache[key] = value
    while len(cache) > _KEEP:
        del cache[next(iter(cache))]


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
    owners: list[_Owner],
    whole: list[str],
    plans: dict[tuple, _Verified | None] | None = None,
    model_state: tuple = (),
) -> tuple[DiagBackpropResult, tuple, _Verified | None]:
    """One Monte-Carlo pass with a given plan (see :func:`_monte_carlo`).

    ``plans`` holds what earlier verified calls found for this model, signature and
    fingerprint (``model_state``), per call structure; ``None``: verify this call. The forward
    pass records its call structure (the owners' calls whose output needs a gradient, each
    with whether it was called on the input, and the parameters' use counts of
    :class:`_RandomOpGuard`). Where ``plans`` has a :class:`_Verified` for that
    structure, the backward passes go to the entries or the input, not to the weights, and
    every draw must reach exactly its module calls; otherwise every draw checks the capture
    against the batch weight gradients.

    Returns:
        The result, the call structure, and for a verified call whose input can carry a
        gradient, what it found.
    """
    handles: list[Any] = []
    taps: list[Any] = []  # the tensor hooks, removed after the backward passes
    state = {"batch": args[0].shape[0] if args and isinstance(args[0], Tensor) else None}
    whole = list(whole)
    leaves = [
        i for i, a in enumerate(args)
        if isinstance(a, Tensor) and a.is_floating_point() and not a.requires_grad
    ]  # fmt: skip
    fast = plans is not None and bool(leaves)  # a later call may skip the weights' gradients
    if fast:
        args = tuple(a.detach().requires_grad_(True) if i in leaves else a
                     for i, a in enumerate(args))  # fmt: skip
    rerouted: list[str] = []
    captured: set[str] = set()
    fired: set[tuple[str, int]] = set()  # (owner path, call index) whose gradient arrived
    calls: list[tuple[str, int, bool]] = []  # the structure: (owner path, call index, entry)
    inputs = [args[i] for i in leaves]
    entries: list[tuple[Tensor, int]] = []  # outputs of module calls on an input, versions

    def check(module: nn.Module, _args: Any) -> None:
        try:
            RULES[type(module)].check(module)
        except ValueError as err:
            raise ValueError(f"'{_path(model, module)}' ({type(module).__name__}): {err}") from None

    guard = _RandomOpGuard(model, count_uses=fast)

    def capture(owner: _Owner):
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            with ModeAside(guard):  # the capture's own code: nothing for the guard to inspect
                return tap(module, args, kwargs, out)

        def tap(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Tensor | None:
            x = args[0] if len(args) == 1 and isinstance(args[0], Tensor) else None
            if kwargs or x is None:
                if not owner.block:
                    raise _ReplanError
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) was called with {len(args)} "
                    f"positional and {len(kwargs)} keyword arguments; the Monte-Carlo estimator "
                    "takes per-sample gradients of modules with one tensor input"
                )
            x = x.detach()
            if not isinstance(out, Tensor) or x.dim() == 0 or x.shape[0] != state["batch"]:
                if not owner.block:
                    raise _ReplanError
                raise NotImplementedError(
                    f"'{owner.path}' ({type(module).__name__}) gets an input of shape "
                    f"{tuple(x.shape)} whose first dimension is not the batch "
                    f"({state['batch']}): per-sample gradients need the samples along dim 0"
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
            # an in-place operation after the module, ReLU(inplace=True), changes it).
            y = out.detach()
            version = y._version

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

    try:
        try:
            for module in all_modules(model):
                rule = RULES.get(type(module))
                if rule is not None and type(rule).check is not Rule.check:
                    handles.append(module.register_forward_pre_hook(check))
            for owner in owners:
                # First among the module's forward hooks: a hook of the user's that changes the
                # output acts after the capture, like any later operation.
                hook = capture(owner)
                handles.append(
                    owner.module.register_forward_hook(hook, with_kwargs=True, prepend=True)
                )
            with torch.enable_grad(), guard:
                logits = model(*args)
        finally:
            for handle in handles:
                handle.remove()
        check_logits(logits)
        f = logits.detach()
        check_finite_logits(f)
        structure = (tuple(calls), tuple(guard.uses.items()) if fast else ())
        verified = plans.get(structure) if fast else None
        if verified is not None:
            for owner in owners:
                owner.names = {o: n for o, n in owner.names.items() if n not in verified.rerouted}
            whole += [n for n in verified.rerouted if n not in whole]
            # A leaf whose parameters no other owner holds, called once, squares its own share:
            # no sums over calls or owners, and no check against batch gradients in these calls.
            held = Counter(n for owner in owners for n in owner.names.values())
            for owner in owners:
                owner.alone = not owner.block and all(held[n] == 1 for n in owner.names.values())
        at_entries = verified is not None and verified.entries
        if not at_entries:
            entries.clear()
        _check_samples_independent(model, owners, args, bool(whole), (model_state, structure))
        value = loss_fn.value(f, targets)
        if noise is None:
            # Held at once: the draws z and the vectors s = B z, [S, *logits.shape] each.
            check_sample_memory(
                "mc_samples", mc_samples, 2 * f.numel(), f,
                "use a smaller mc_samples (the estimate's variance falls as 1/mc_samples; the "
                "mean of several calls with fewer samples is the same estimator), or a smaller "
                "batch",
            )  # fmt: skip
            shape = (mc_samples, *f.shape)
            noise = torch.randint(0, 2, shape, generator=generator, device=f.device)
            noise = noise.to(f.dtype) * 2 - 1
        vectors = loss_fn.hessian_sqrt(f, targets, noise)
        totals: dict[str, Tensor] = {}
        expected: dict[str, Tensor] = {}  # Σ over draws of the batch gradients, whole-model path
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
                intact = entries and all(t._version == v for t, v in entries)
                ends = [t for t, _ in entries] if intact else inputs
                wanted = ends + [by_name[n] for n in whole]
                grads = torch.autograd.grad(
                    logits, wanted, vectors[k], retain_graph=keep, allow_unused=True
                )
                total_grads = dict(zip(whole, grads[len(ends) :], strict=True))
            per_sample, lost = _gather(owners, total_grads)
            squares = _gather_squares(owners)
            if verified is not None and (
                set(per_sample) | set(squares) != verified.captured or fired != verified.fired
            ):
                raise _UnverifiedError(noise, structure, verified, at_entries=bool(intact))
            if k == 0:
                first_fired = frozenset(fired)
            fired.clear()
            if lost and k == 0:
                # The capture cannot serve these: the whole model serves them, for all draws.
                for owner in owners:
                    owner.names = {o: n for o, n in owner.names.items() if n not in lost}
                whole += [n for n in names if n in lost]
                rerouted += [n for n in names if n in lost]
            elif lost:
                name, what = next(iter(lost.items()))
                _lost(model, name, owners, what)
            for name in whole:
                g = total_grads[name]
                if g is not None:
                    expected[name] = expected[name] + g if name in expected else g
            for name, g in per_sample.items():
                if name in lost:
                    continue
                captured.add(name)
                # In place: every per-sample gradient owns its memory (a new tensor from the
                # direct kernels or _gather's sums, or _own's copy of an alias of g).
                squares[name] = _square_sum(g)
            for name, sq in squares.items():
                totals[name] = totals[name].add_(sq) if name in totals else sq
    finally:
        # The hooks hold the module inputs; removing them lets the graph go with the call.
        for tap in taps:
            tap.remove()
        entries.clear()
        for owner in owners:
            owner.partial = owner.squares = None
    del logits
    if whole:
        totals.update(_whole_model(model, args, names, chosen, whole, vectors, f, expected))
    if mc_samples > 1 and totals:  # the sums are this call's own tensors: averaged in place
        torch._foreach_div_(list(totals.values()), mc_samples)
    diagonals = {
        n: totals[n] if n in totals else torch.zeros_like(p)
        for n, p in zip(names, chosen, strict=True)
    }
    check_finite_result(diagonals, f.dtype, "Monte-Carlo")
    paths = dict.fromkeys(whole, _BY_MODEL)
    for owner in owners:
        for n in owner.names.values():
            paths.setdefault(n, owner.how())
    mc_paths = {n: paths.get(n, _BY_MODULE) for n in names}
    result = DiagBackpropResult(
        loss=value.detach(), logits=f, diagonals=diagonals, mc_paths=mc_paths
    )
    found = None
    if verified is None and fast:
        found = _Verified(frozenset(captured), tuple(rerouted), first_fired)
    return result, structure, found


def _whole_model(
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
        with torch.no_grad(), _RandomOpGuard(model):
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return ok


def _plan(
    model: nn.Module,
    names: list[str],
    chosen: list[Tensor],
    args: tuple,
    replan: bool,
    force: str | None,
) -> tuple[list[_Owner], list[str]]:
    """Owners (leaf modules and blocks) and the parameters served by the whole model.

    A parameter tied across modules (``b.weight = a.weight``) has several owners; their
    per-sample gradients are summed before squaring (:func:`_gather`). Without ``replan``, and
    when every owner is a leaf without parametrizations, all owners are leaves and nothing is
    probed (the capture raises :class:`_ReplanError` if a leaf turns out to be called on folded or
    several inputs). Otherwise one forward pass without grad finds which modules are called
    with one tensor whose dim 0 is the batch, and each parameter goes to its leaf if that can
    serve, else to the smallest such enclosing module (a block), else to the whole model.
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
        return [_Owner(m, path or "<model>", own) for path, m, own in held], []
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
        owners.append(_Owner(module, b, own, block=True))
    for path, module, own in leaves:
        if any(path.startswith(b + ".") for b in blocks):
            continue
        own = {k: n for k, n in own.items() if n not in whole}
        if own:
            owners.append(_Owner(module, path or "<model>", own))
    for owner in owners:
        owner.names = {k: n for k, n in owner.names.items() if n not in whole}
    return [o for o in owners if o.names], [n for n in names if n in whole]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


# (model, input shapes and dtypes, state) already checked by _check_samples_independent.
_INDEPENDENT: weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]] = weakref.WeakKeyDictionary()


def _check_samples_independent(
    model: nn.Module, owners: list[_Owner], args: tuple, whole: bool = False, state: tuple = ()
) -> None:
    """Verify once per model and state that dim 0 of every owner's input is the batch.

    ``state`` is what else the answer depends on (:func:`_run` passes the model's fingerprint
    and the call structure: a mode switch, a swapped module or another branch checks again).

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

    def record(owner: _Owner):
        def hook(module: nn.Module, hook_args: tuple) -> None:
            if hook_args and isinstance(hook_args[0], Tensor) and hook_args[0].requires_grad:
                seen.append((owner.describe(), "input", hook_args[0]))

        return hook

    def record_output(owner: _Owner):
        def hook(module: nn.Module, hook_args: tuple, out: Any) -> None:
            if isinstance(out, Tensor) and out.requires_grad:
                seen.append((f"the block {owner.describe()}", "output", out))

        return hook

    handles = [o.module.register_forward_pre_hook(record(o)) for o in owners]
    handles += [
        o.module.register_forward_hook(record_output(o), prepend=True) for o in owners if o.block
    ]
    try:
        with torch.enable_grad(), _RandomOpGuard(model):
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
    _keep(done, key, True)


def _path(model: nn.Module, module: nn.Module) -> str:
    return next((n or "<model>" for n, m in model.named_modules() if m is module), "?")
