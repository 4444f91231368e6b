"""Reference curvature estimators: the exact GGN diagonal and its one-sample Monte-Carlo estimate.

These are the yardsticks diagonal backpropagation is measured against, not tools for large
images. :func:`exact_ggn_diagonal` needs one vector-Jacobian product per output entry
(``N·K·H·W`` of them, each a backward pass through the whole batch), so its cost grows
quadratically with the number of pixels. :func:`mc_ggn_diagonal` costs one per-sample backward
pass per Monte-Carlo sample and is unbiased, but noisy.

Both run the model through :func:`torch.func.functional_call` with detached copies of its
parameters and buffers, in the model's current mode: the model itself is left unchanged.

Shape legend: ``N`` batch, ``K`` output channels (classes), ``*`` spatial dimensions,
``P`` number of trainable parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import grad, vjp, vmap

from lsn_ext._functional import functional_call_all
from lsn_ext._memory import check_sample_memory
from lsn_ext.engine import check_finite_logits, check_finite_result, check_inputs
from lsn_ext.rules.losses import BCEWithLogits, CrossEntropy, Loss, as_loss

__all__ = ["exact_ggn_diagonal", "flatten_diagonals", "mc_ggn_diagonal"]


def _trainable(model: nn.Module) -> dict[str, Tensor]:
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters with requires_grad=True")
    return params


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    # Copies, so that a train-mode BatchNorm updates these and not the model's running stats.
    return {k: b.detach().clone() for k, b in model.named_buffers()}


def _hessian_factors(loss: Loss, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """A factorisation ``H = Σ_k v_k v_kᵀ`` of the loss Hessian, one position at a time.

    Args:
        loss: The loss.
        logits: ``[N, K, *]`` (or any shape for a diagonal Hessian).
        targets: As the loss expects them.

    Returns:
        ``(index, values)``: ``index`` ``[V, R]`` holds flat indices into ``logits`` and
        ``values`` ``[V, R]`` the entries of ``V`` factor vectors, each supported on ``R``
        entries (``R = 1`` for a diagonal Hessian, ``R = K`` for a per-position ``K×K`` block).
        Vectors that are zero (zero Hessian, or zero eigenvalues of a block) are left out.
    """
    flat_index = torch.arange(logits.numel(), device=logits.device).reshape(logits.shape)
    block = loss.hessian_block(logits, targets)
    if block is None:
        h = loss.hessian_diag(logits, targets).reshape(-1)
        keep = h > 0
        return flat_index.reshape(-1, 1)[keep], h[keep].sqrt().unsqueeze(1)

    # Block [N, K, K, *] -> one K×K matrix per position; eigendecomposition H = U Λ Uᵀ gives
    # v_k = sqrt(λ_k) u_k (softmax blocks have rank K − 1: the zero eigenvalue is dropped).
    K = logits.shape[1]
    blocks = block.movedim((1, 2), (-2, -1)).reshape(-1, K, K)
    index = flat_index.movedim(1, -1).reshape(-1, K)
    eigvals, eigvecs = torch.linalg.eigh(blocks)  # [B, K], [B, K, K] (columns)
    tol = eigvals.abs().amax(-1, keepdim=True) * K * torch.finfo(logits.dtype).eps
    keep = eigvals > tol  # [B, K]
    vectors = (eigvecs * eigvals.clamp_min(0).sqrt().unsqueeze(-2)).transpose(-2, -1)  # [B, K, K]
    index = index.unsqueeze(1).expand(-1, K, -1)  # [B, K(vector), K(entry)]
    return index[keep], vectors[keep]


def exact_ggn_diagonal(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: str | Loss | nn.Module,
    *,
    chunk_size: int = 256,
) -> dict[str, Tensor]:
    r"""The exact diagonal of the generalised Gauss-Newton matrix ``Σ_n diag(J_nᵀ H_n J_n)``.

    With the loss Hessian factored as ``H = Σ_k v_k v_kᵀ`` (``v_o = √h_o e_o`` for a diagonal
    Hessian such as BCE or MSE; per position ``√λ u`` from the eigendecomposition of the
    ``K×K`` cross-entropy block ``w_y(diag p − ppᵀ)``, rank ``K − 1``), the diagonal is
    ``Σ_k (Jᵀ v_k)²``: one vector-Jacobian product per factor vector, evaluated with
    :func:`torch.func.vmap` in chunks of ``chunk_size``. The Jacobian is that of the whole
    batch's output, so batch-coupled layers (train-mode batch norm) are handled correctly.

    This is a reference for small inputs: it needs about ``N·K·H·W`` backward passes through the
    whole batch, quadratic in the number of pixels (3-level U-Net, 32×32, batch 2: seconds;
    256×256: hours). Diagonal backpropagation costs one.

    Args:
        model: Maps ``inputs`` to logits ``[N, K, *]``; evaluated in its current mode (for a
            deterministic result, call ``model.eval()`` when it has dropout). Left unchanged.
        inputs: The batch ``[N, ...]``.
        targets: As the loss expects them (BCE: like the logits or ``[N, *]`` for one output
            channel; cross-entropy: class indices ``[N, *]``; MSE: like the logits).
        loss: ``"bce"``, ``"ce"``, ``"mse"``, a :class:`~lsn_ext.rules.losses.Loss` or a
            ``torch.nn`` loss module (see :func:`~lsn_ext.rules.losses.as_loss`).
        chunk_size: Factor vectors pushed through one vectorised VJP; memory grows linearly
            with it (about ``chunk_size`` × the memory of one backward pass).

    Returns:
        ``{name: diagonal}`` for every parameter with ``requires_grad``, named and shaped as in
        ``model.named_parameters()``; non-negative.

    Raises:
        ValueError: For ``chunk_size < 1``, a model without trainable parameters, or targets the
            loss rejects.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    loss = as_loss(loss)
    params = _trainable(model)
    check_inputs(model, (inputs,))
    buffers = _buffers(model)

    def f(p: dict[str, Tensor]) -> Tensor:
        # Buffers cloned inside the transform: train-mode batch norm may update them in place.
        own = {k: b.clone() for k, b in buffers.items()}
        return functional_call_all(model, {**own, **p}, (inputs,))

    logits, vjp_fn = vjp(f, params)
    logits = logits.detach()
    check_finite_logits(logits)
    index, values = _hessian_factors(loss, logits, targets)

    def pullback(v: Tensor) -> dict[str, Tensor]:
        return vjp_fn(v.reshape(logits.shape))[0]

    diag = {k: torch.zeros_like(p) for k, p in params.items()}
    for start in range(0, index.shape[0], chunk_size):
        idx, val = index[start : start + chunk_size], values[start : start + chunk_size]
        vectors = torch.zeros(
            idx.shape[0], logits.numel(), dtype=logits.dtype, device=logits.device
        )
        vectors.scatter_(1, idx, val)
        for k, g in vmap(pullback)(vectors).items():
            diag[k] += g.square().sum(0)
    check_finite_result(diag, logits.dtype, "exact GGN")
    return diag


def _sample_output_gradient(
    loss: Loss, logits: Tensor, targets: Tensor, mc_samples: int, generator: torch.Generator | None
) -> Tensor:
    """``mc_samples`` draws of ``s`` with ``E[s sᵀ] = H`` per position; ``[S, *logits.shape]``.

    BCE: ``s = (σ(f) − ỹ) · √(h / σ(f)(1 − σ(f)))``, ``ỹ ~ Bernoulli(σ(f))`` (for the plain loss
    ``s = σ(f) − ỹ``, the gradient at the sampled target). Cross-entropy: ``s = √w (p − e_ỹ)``,
    ``ỹ ~ Categorical(p)`` per position, ``w`` the position weight. Any other loss:
    ``s = H^{1/2} z`` with ``z ~ N(0, I)`` (for MSE the gradient at a target drawn from the
    model's Gaussian likelihood).
    """
    shape = (mc_samples, *logits.shape)
    if isinstance(loss, BCEWithLogits):
        p = torch.sigmoid(logits)
        scale = (loss.hessian_diag(logits, targets) / (p * (1 - p))).nan_to_num(0.0).sqrt()
        y = torch.bernoulli(p.expand(shape), generator=generator)
        return (p - y) * scale
    if isinstance(loss, CrossEntropy):
        p = torch.softmax(logits, 1)
        # w_y from the Hessian diagonal: Σ_c h_c = w_y Σ_c p_c(1 − p_c).
        denom = (p * (1 - p)).sum(1)
        w = (loss.hessian_diag(logits, targets).sum(1) / denom).nan_to_num(0.0).clamp_min(0)
        probs = p.movedim(1, -1).reshape(-1, p.shape[1])
        y = torch.multinomial(probs, mc_samples, replacement=True, generator=generator)  # [B, S]
        y = y.T.reshape(mc_samples, *p.shape[:1], *p.shape[2:])
        onehot = torch.nn.functional.one_hot(y, p.shape[1]).movedim(-1, 2).to(p.dtype)
        return (p - onehot) * w.sqrt().unsqueeze(1)
    index, values = _hessian_factors(loss, logits, targets)
    z = torch.randn(
        mc_samples, index.shape[0], 1, generator=generator, dtype=logits.dtype, device=logits.device
    )
    s = torch.zeros(mc_samples, logits.numel(), dtype=logits.dtype, device=logits.device)
    s.scatter_add_(1, index.reshape(1, -1).expand(mc_samples, -1), (z * values).flatten(1))
    return s.reshape(shape)


def mc_ggn_diagonal(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: str | Loss | nn.Module,
    *,
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """Monte-Carlo GGN diagonal ``(1/S) Σ_s Σ_n (J_nᵀ s_n)²``, unbiased for the exact diagonal.

    The estimator of BackPACK's ``DiagGGNMC``: per sample ``n`` and draw, targets are sampled
    from the model's predictive (``Bernoulli(σ(f))`` per entry for BCE, ``Categorical(softmax)``
    per position for cross-entropy) and ``s_n`` is the gradient of the loss w.r.t. the logits at
    the sampled targets, so ``E[s sᵀ] = H``; per-sample parameter gradients ``J_nᵀ s_n`` come from
    :func:`torch.func.vmap` over the batch and the draws of :func:`torch.func.grad`, without a
    Python loop (memory ``S·N·P``). Class / element weights, ``pos_weight`` and
    ``reduction="mean"`` rescale ``s`` so that ``E[s sᵀ]`` still equals the loss Hessian;
    losses other than BCE and cross-entropy use ``s = H^{1/2} z``, ``z ~ N(0, I)`` (for MSE,
    the gradient at Gaussian-sampled targets).

    Per-sample gradients treat the samples as independent: the model must not couple them
    (no train-mode batch norm). Stochastic layers draw fresh randomness per sample.

    Args:
        model: Maps ``inputs`` to logits ``[N, K, *]``; left unchanged.
        inputs: The batch ``[N, ...]``.
        targets: The observed targets (they enter only through loss weights that depend on
            them, e.g. ``pos_weight``).
        loss: As in :func:`exact_ggn_diagonal`.
        mc_samples: Draws ``S`` per sample, averaged.
        generator: Random generator for the sampled targets.

    Returns:
        ``{name: diagonal}`` for every parameter with ``requires_grad``, as in
        :func:`exact_ggn_diagonal`.

    Raises:
        ValueError: For ``mc_samples < 1``, more draws than the device's memory holds (naming
            the memory they need), or a model without trainable parameters.
    """
    if mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive int, got {mc_samples}")
    loss = as_loss(loss)
    params = _trainable(model)
    check_inputs(model, (inputs,))
    buffers = _buffers(model)
    with torch.no_grad():
        logits = functional_call_all(model, {**buffers, **params}, (inputs,))
    check_finite_logits(logits)
    # Held at once: the draws s [S, N, ...] and the per-sample gradients [S, N, P].
    n_params = sum(p.numel() for p in params.values())
    check_sample_memory(
        "mc_samples",
        mc_samples,
        logits.numel() + inputs.shape[0] * n_params,
        logits,
        "use fewer draws (the estimate's variance falls as 1/mc_samples: average calls with "
        "different generators for more), or a smaller batch",
    )
    s = _sample_output_gradient(loss, logits, targets, mc_samples, generator)  # [S, N, ...]

    def contracted(p: dict[str, Tensor], x: Tensor, s_n: Tensor) -> Tensor:
        own = {k: b.clone() for k, b in buffers.items()}
        out = functional_call_all(model, {**own, **p}, (x.unsqueeze(0),))
        return (out.squeeze(0) * s_n).sum()

    per_sample = vmap(grad(contracted), in_dims=(None, 0, 0), randomness="different")
    per_draw = vmap(per_sample, in_dims=(None, None, 0), randomness="different")
    grads = per_draw(params, inputs, s)  # {name: [S, N, *p.shape]}
    diag = {k: g.square().sum((0, 1)) / mc_samples for k, g in grads.items()}
    check_finite_result(diag, logits.dtype, "Monte-Carlo")
    return diag


def flatten_diagonals(model: nn.Module, diagonals: Mapping[str, Tensor]) -> Tensor:
    """Concatenate per-parameter diagonals in ``model.parameters()`` order.

    Args:
        model: The model the diagonals belong to.
        diagonals: ``{name: diagonal}`` as returned by :func:`exact_ggn_diagonal`.

    Returns:
        ``[P]``, the diagonals of the parameters with ``requires_grad`` (the order of
        ``parameters_to_vector`` over those parameters).

    Raises:
        KeyError: If a trainable parameter has no diagonal.
        ValueError: If a diagonal's shape differs from its parameter's.
    """
    parts = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name not in diagonals:
            raise KeyError(f"no diagonal for parameter {name!r}; got {sorted(diagonals)}")
        d = diagonals[name]
        if d.shape != p.shape:
            raise ValueError(
                f"diagonal of {name!r} has shape {tuple(d.shape)}, parameter {tuple(p.shape)}"
            )
        parts.append(d.reshape(-1))
    return torch.cat(parts)
