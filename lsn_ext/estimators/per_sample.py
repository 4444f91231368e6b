"""Per-sample gradients of convolutions, ``nn.Linear`` and norm layers without replay, and squares.

The Monte-Carlo estimator needs ``J_nᵀ g_n`` per sample ``n`` for each parametric leaf module,
from the module's input ``x`` and the gradient ``g`` at its output. For the common layers these
come from one kernel call, without running the module again (:func:`direct_sample_grads`);
other modules are replayed per sample (:mod:`lsn_ext.estimators.replay`). :func:`square_sum`
squares per-sample gradients and sums them over the samples, the same way for every caller.

Which kernel serves a module is a fact of its rule (``Rule.per_sample_kernel``), taken for
modules of a ``torch.nn`` class itself only (:func:`direct_kernel`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lsn_ext._kernels import choose, timing_applies
from lsn_ext.rules import RULES
from lsn_ext.rules.base import PerSampleKernel

_FAMILIES: dict[str, tuple[type[nn.Module], ...]] = {
    "convolution": (nn.modules.conv._ConvNd,),
    "linear": (nn.Linear,),
    "norm": (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm),
}
"""The modules each kernel computes for: it reads their attributes (``transposed``, ``stride``,
…) and assumes their ``forward``."""


def direct_kernel(module: nn.Module) -> PerSampleKernel | None:
    """The direct kernel that serves ``module``'s per-sample gradients, or ``None`` (replay).

    The kernel named by the rule registered for the module's exact class
    (``Rule.per_sample_kernel``), where that class is a ``torch.nn`` class itself of the
    kernel's family (:data:`_FAMILIES`) and ``forward`` was not replaced on the instance.

    Why not every class registered with such a rule: a kernel takes its gradients from the
    module's input and output gradient alone and never runs the module, so no replay compares
    what the module computes with what the kernel assumes. A subclass registered with
    ``ConvRule`` may compute something else, through its own ``forward`` (weight
    standardisation: ``conv(x, (W − mean W) / std W)``) or through a method that torch's
    ``forward`` calls (``_conv_forward``, ``_output_padding``, ``_check_input_dim``); a kernel
    would give it the gradients of the plain convolution. The Monte-Carlo estimator's check that
    the per-sample gradients sum to the batch gradient catches such a mismatch in the tests'
    weight-standardised convolutions (and reroutes the weight through the whole model), but it
    runs in verified calls only, sees the sum over the samples only, within its tolerance, and
    skips parameters whose gradients are below ``√eps`` of the draw's largest. A subclass is
    therefore replayed per sample, running its own forward, its outputs checked against the
    batched forward's in every call (StochMan's ``nnj.Conv2d`` too, as before), and the kernels
    serve exactly the classes whose code is torch's own.
    """
    cls = type(module)
    if not cls.__module__.startswith("torch.nn.") or "forward" in vars(module):
        return None
    rule = RULES.get(cls)
    kernel = None if rule is None else rule.per_sample_kernel
    if kernel is None or not isinstance(module, _FAMILIES[kernel]):
        return None
    return kernel


def direct_sample_grads(
    module: nn.Module, names: dict[str, str], x: Tensor, g: Tensor, squared: bool = False
) -> dict[str, Tensor] | None:
    """Per-sample gradients of a convolution, ``nn.Linear`` or norm layer without replay.

    The weight gradient of one sample needs only its input and output gradient: for a
    convolution (or transposed convolution) ``aten.convolution_backward`` with only the weight
    (and bias) outputs, grouped over the samples or one call per sample
    (:func:`_conv_sample_grads`; what ``vmap`` of the kernel computes, without its per-call
    overhead); for ``nn.Linear`` ``g_nᵀ x_n`` summed over the
    other axes; for a norm layer (:func:`_norm_sample_grads`) ``Σ g_n · x̂_n`` and ``Σ g_n``.
    The replay of :meth:`~lsn_ext.estimators.replay.Owner.sample_grads` also runs the module's
    forward again; these do not. ``None`` for a module that no kernel serves
    (:func:`direct_kernel`: other modules, subclasses included, and a module whose ``forward``
    was replaced on the instance), a convolution with another padding mode or a padding string,
    and where the convolution's kernel fails (the caller then replays the module).

    With ``squared``, the sums of their squares over the samples, ``Σ_n (J_nᵀ g_n)²``.

    Returns:
        ``{own name: [N, *shape]}`` for the names in ``names`` (``{own name: shape}`` with
        ``squared``), or ``None``.
    """
    kernel = direct_kernel(module)
    if kernel is None:
        return None
    want_w, want_b = "weight" in names, "bias" in names
    if kernel == "linear":
        out: dict[str, Tensor] = {}
        if want_w:
            out["weight"] = torch.einsum("n...o,n...i->noi", g, x)
        if want_b:
            out["bias"] = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        return {k: square_sum(v) for k, v in out.items()} if squared else out
    if kernel == "norm":
        out = _norm_sample_grads(module, want_w, want_b, x, g)
        if out is None or not squared:
            return out
        return {k: square_sum(v) for k, v in out.items()}
    transposed, dims = module.transposed, module.weight.dim() - 2
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
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
        return tuple(square_sum(t) if squared and t is not None else t for t in grads)

    def per_sample() -> tuple[Tensor | None, Tensor | None]:
        # The weight itself (contiguous): CPU kernels copy a stand-in expanded zero per call.
        args = (bias, stride, padding, dilation, transposed, out_padding, groups, mask)
        # Squared, a large gradient is accumulated sample by sample as square_sum would (the
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
        return tuple(square_sum(t) if squared and t is not None and not running[k] else t
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
        grads["bias"] = own(total(g), g)
    return grads


def own(t: Tensor, *inputs: Tensor) -> Tensor:
    """``t``, or a copy where it shares memory with one of ``inputs``.

    Per-sample gradients are squared in place (the draws of
    :mod:`~lsn_ext.estimators.monte_carlo`), so each must own its memory: a replay's gradient
    can be its input itself (``vjp`` of ``x + b`` gives ``g`` for ``b``), and the output
    gradient ``g`` can be the Monte-Carlo vectors or be shared with other modules.
    """
    ptr = t.untyped_storage().data_ptr()
    if any(ptr == i.untyped_storage().data_ptr() for i in inputs):
        return t.clone()
    return t


_SQUARE_SUM_LOOP = 2**14
"""Entries per sample from which :func:`square_sum` accumulates sample by sample."""


def _square_sum_loops(n: int, shape: torch.Size, device: torch.device) -> bool:
    """Whether :func:`square_sum` accumulates sample by sample for ``[n, *shape]``.

    On CPU only: a GPU reads memory fast enough, and ``n`` kernel launches would cost more.
    """
    return device.type == "cpu" and n > 1 and shape.numel() >= _SQUARE_SUM_LOOP


def square_sum(t: Tensor) -> Tensor:
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
