r"""The linearised (GLM) predictive for dense outputs, one Jacobian-vector product per sample.

Under a Gaussian posterior ``q(θ) = N(θ*, Σ)`` (a Laplace approximation, or a variational
Gaussian), the *linearised* network

.. math::

    f_{lin}(x; θ) = f(x; θ*) + J(x)\,(θ - θ*), \qquad J = ∂f/∂θ \text{ at } θ*,

has Gaussian outputs ``N(f(x; θ*), J Σ Jᵀ)`` (Immer et al., AISTATS 2021: the predictive of the
generalised linear model that the GGN-Laplace approximation is the posterior of; sampling the
network itself, the "nn" predictive, underfits). laplace-torch computes it from explicit
Jacobians ``[outputs, P]``, which for a segmentation map of ``N·C·H·W`` outputs is out of reach.

Here each posterior draw ``θ_s = θ* + δ_s`` is pushed through the linearised network by one
forward-mode Jacobian-vector product, ``J δ_s`` (:func:`torch.func.jvp` of the network as a
function of its parameters): memory of one forward pass, cost of about two forward passes, linear
in the pixels, and independent of the number of samples (draws are made in chunks). Draws come in
antithetic pairs ``θ* ± δ_s``: one JVP gives two samples, ``f* ± J δ_s``, and the mean of the
sampled logits is exactly ``f*``. The per-output logit variance ``diag(J Σ Jᵀ)`` is estimated by
``(1/S) Σ_s (J δ_s)²`` over the ``S = ⌈n/2⌉`` distinct products: unbiased (the mean is known to be
zero), with relative standard error ``√(2/S)`` per output.

Operations without forward-mode AD support fall back, with a warning that names the operation, to
the double-backward trick ``J δ = ∂/∂u (Jᵀ u) · δ`` (one backward pass through the retained
backward graph per sample: the memory of a training step, the same result).

Attention runs through its math kernel for the tangents (:func:`differentiable_attention`):
``nn.MultiheadAttention``'s fused fast path has no forward-mode AD, and the fused
``scaled_dot_product_attention`` kernels (flash attention on the CPU) no double backward. The
logits ``f(x; θ*)`` themselves come from the model's default kernels.

Shape legend: ``N`` batch, ``C`` output channels, ``*`` spatial dimensions, ``P`` the number of
parameters with ``requires_grad``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from lsn_ext._functional import functional_call_all

__all__ = ["linearized_tangents", "sample_chunks"]

# Posterior draws are materialised about this many numbers at a time (8 MiB in float64), or 16
# draws for networks of more than 2**16 parameters.
_DRAW_BUDGET = 2**20


def sample_chunks(
    sample: Callable[..., Tensor], n: int, n_params: int, generator: torch.Generator | None
) -> Iterator[Tensor]:
    """Draws ``[n, P]`` from ``sample(k, generator=...)``, ``max(2²⁰, 16 P)`` numbers at a time.

    Memory is bounded independently of ``n``. When all ``n`` draws fit in one chunk, this is
    exactly ``sample(n, generator=generator)``. Chunks hold a multiple of 16 numbers (torch's
    CPU ``randn`` fills blocks of 16): with torch 2.13, laplace-torch's diagonal ``sample`` then
    gives the same draws in chunks as in one call for the networks in the tests (not guaranteed
    in general: the draws may depend on the chunking).

    Yields:
        Draws ``[k, P]``, ``k ≤ n``, in order, ``n`` in total.
    """
    step = 16 // math.gcd(n_params, 16)
    chunk = max(step, _DRAW_BUDGET // max(n_params, 1) // step * step)
    chunk = min(n, chunk)
    done = 0
    while done < n:
        k = min(chunk, n - done)
        yield sample(k, generator=generator)
        done += k


@contextlib.contextmanager
def differentiable_attention() -> Iterator[None]:
    """Attention by its math kernel, which forward-mode AD and double backward both run through.

    Turns off ``nn.MultiheadAttention``'s (and ``nn.TransformerEncoderLayer``'s) fused fast path,
    which gradient-free calls take and which has no forward-mode AD, and restricts
    ``F.scaled_dot_product_attention`` to its math backend (the fused kernels' backward is not
    differentiable). Both settings are restored on exit. Same function, other round-off.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


def forward_ad_unsupported(error: Exception) -> bool:
    """Whether ``error`` says an operation has no forward-mode AD."""
    text = str(error)
    return "forward AD" in text or "forward-mode" in text or "jvp" in text.lower()


def linearized_tangents(
    model: nn.Module,
    names: Sequence[str],
    mean: Tensor,
    x: Tensor,
    deltas: Iterator[Tensor],
    run: Callable[[Callable[[Tensor], Tensor], Tensor], Tensor] | None = None,
) -> tuple[Tensor, Iterator[Tensor]]:
    """``f(x; θ*)`` and the products ``J(x) δ_s`` for a stream of parameter offsets.

    Args:
        model: The network; run with ``functional_call`` (every alias of a shared parameter
            substituted) and with copies of its buffers, so it is never modified.
        names: Names of the parameters with ``requires_grad``, in ``named_parameters()`` order;
            ``mean`` and every ``δ`` concatenate them in this order.
        mean: ``θ*`` ``[P]``, the linearisation point (the posterior mean).
        x: Inputs ``[N, C_in, *spatial]``.
        deltas: Offsets ``δ_s`` ``[P]`` (e.g. posterior draws minus the mean).
        run: How the network is applied to ``x``: ``run(network, x)`` with ``network`` the
            model at the given parameters as a function of its input (e.g. a
            :class:`~lsn_ext.SlidingWindow`); ``None`` calls it on ``x`` directly.

    Returns:
        ``(f*, tangents)``: the logits at ``θ*`` ``[N, C, *]``, and a lazy iterator over
        ``J δ_s`` ``[N, C, *]`` (one JVP per ``δ_s`` as it is consumed).
    """
    params = dict(model.named_parameters())
    shapes = [params[n].shape for n in names]
    sizes = [s.numel() for s in shapes]
    buffers = dict(model.named_buffers())

    def split(vector: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.view(s) for t, s in zip(vector.split(sizes), shapes, strict=True))

    def f(*theta: Tensor) -> Tensor:
        tensors = dict(zip(names, theta, strict=True))
        tensors.update({n: b.clone() for n, b in buffers.items()})
        network = lambda inputs: functional_call_all(model, tensors, (inputs,))  # noqa: E731
        return network(x) if run is None else run(network, x)

    primals = split(mean)
    with torch.no_grad():
        f_map = f(*primals)

    def forward_mode() -> Iterator[Tensor]:
        first = True
        for delta in deltas:
            try:
                with differentiable_attention():
                    _, tangent = torch.func.jvp(f, primals, split(delta))
            except (NotImplementedError, RuntimeError) as error:
                if not (first and forward_ad_unsupported(error)):
                    raise
                warnings.warn(
                    f"{type(model).__name__} has an operation without forward-mode AD "
                    f"({str(error).splitlines()[0][:160]}); the GLM predictive falls back to "
                    "double backward (same result, the memory of a training step)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                yield from double_backward(delta)
                return
            first = False
            yield tangent.detach()

    def double_backward(first_delta: Tensor) -> Iterator[Tensor]:
        with torch.enable_grad():
            leaves = [p.detach().requires_grad_(True) for p in primals]
            with differentiable_attention():
                out = f(*leaves)
            u = torch.zeros_like(out, requires_grad=True)
            vjp = torch.autograd.grad(out, leaves, u, create_graph=True, allow_unused=True)
            used = [(g, i) for i, g in enumerate(vjp) if g is not None]
            for delta in itertools.chain((first_delta,), deltas):
                pieces = split(delta)
                (jd,) = torch.autograd.grad(
                    [g for g, _ in used], u, [pieces[i] for _, i in used], retain_graph=True
                )
                yield jd.detach()

    return f_map, forward_mode()
