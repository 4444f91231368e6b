"""Dense, loop-based references for KFAC factors and exact GGN blocks (independent of lsn_ext.kron).

The factors follow their definition literally: the layer inputs and outputs are recorded by
plain forward hooks, the output gradients come from ``torch.autograd.grad`` w.r.t. the recorded
outputs, and the patches are gathered index by index in Python loops. Every reference checks
itself: ``Σ_{n,t} r cᵀ`` must equal the weight's autograd gradient.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from tests.reference import loss_hessian_dense

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _pads(module: nn.Module) -> list[tuple[int, int]]:
    if module.padding == "same":
        out = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return out
    if module.padding == "valid":
        return [(0, 0)] * len(module.kernel_size)
    return [(p, p) for p in module.padding]


def conv_patches(module: nn.Module, x: Tensor) -> Tensor:
    """``[N, T, C_in · ∏k]`` by loops: ``a[n, o, (c, k)] = x_pad[n, c, o·s + k·d]``."""
    pads = _pads(module)
    flat = [p for pair in reversed(pads) for p in pair]
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    xp = F.pad(x, flat, mode=mode) if any(flat) else x
    k, s, d = module.kernel_size, module.stride, module.dilation
    size = [(xp.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(len(k))]
    N, C = x.shape[:2]
    out = torch.zeros(N, math.prod(size), C, math.prod(k), dtype=x.dtype)
    for t, o in enumerate(itertools.product(*map(range, size))):
        for j, kk in enumerate(itertools.product(*map(range, k))):
            idx = tuple(o[i] * s[i] + kk[i] * d[i] for i in range(len(k)))
            out[:, t, :, j] = xp[(slice(None), slice(None), *idx)]
    return out.reshape(N, math.prod(size), -1)


def transposed_columns(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``[N, T_in, C_out · ∏k]`` by loops: ``ĝ[n, t, (o, k)] = g[n, o, t·s + k·d − p]`` or 0."""
    k, s, d, p = module.kernel_size, module.stride, module.dilation, module.padding
    N, C = g.shape[:2]
    size = x.shape[2:]
    out = torch.zeros(N, math.prod(size), C, math.prod(k), dtype=g.dtype)
    for t, pos in enumerate(itertools.product(*map(range, size))):
        for j, kk in enumerate(itertools.product(*map(range, k))):
            idx = tuple(pos[i] * s[i] + kk[i] * d[i] - p[i] for i in range(len(k)))
            if all(0 <= idx[i] < g.shape[2 + i] for i in range(len(k))):
                out[:, t, :, j] = g[(slice(None), slice(None), *idx)]
    return out.reshape(N, math.prod(size), -1)


def _sides(module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """rows ``[N, T, R]``, columns ``[N, T, D_total]`` and output rows ``[N, T_out, C_out]``."""
    if isinstance(module, nn.Linear):
        r = g.reshape(g.shape[0], -1, g.shape[-1])
        c = x.reshape(x.shape[0], -1, x.shape[-1])
        return r, c, r
    out_rows = g.flatten(2).transpose(1, 2)
    if type(module) in CONV:
        return out_rows, conv_patches(module, x), out_rows
    return x.flatten(2).transpose(1, 2), transposed_columns(module, x, g), out_rows


def _moment(v: Tensor, mode: str, mean: bool) -> Tensor:
    """``Σ_{n,t} v vᵀ`` (expand) or ``Σ_n v̄ v̄ᵀ`` (reduce, v̄ the sum or mean over t), by loops."""
    N, T, D = v.shape
    out = torch.zeros(D, D, dtype=v.dtype)
    for n in range(N):
        if mode == "expand":
            for t in range(T):
                out += torch.outer(v[n, t], v[n, t])
        else:
            s = v[n].sum(0) / (T if mean else 1)
            out += torch.outer(s, s)
    return out


def reference_factors(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss,
    z: Tensor,
    mode: str,
    N_data: int | None = None,
    bias_block: str = "exact",
) -> dict[str, list[Tensor]]:
    """KFAC entries of every Linear/Conv/ConvTranspose weight and bias, from their definition.

    ``z`` ``[S, *logits.shape]`` are the draws; the factor that holds them is averaged over them.
    A bias's block is the per-sample moment of the output gradients summed over positions
    (``bias_block="exact"``) or the moment of the weight's mode (``"kfac"``).
    """
    calls: list[tuple[nn.Module, Tensor, Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: calls.append((m, a[0], o)))
        for m in model.modules()
        if isinstance(m, (nn.Linear, *CONV, *TRANSPOSED))
    ]
    try:
        logits = model(x)
    finally:
        for h in hooks:
            h.remove()
    vectors = loss.hessian_sqrt(logits.detach(), y, z)
    S, batch = z.shape[0], x.shape[0]
    N_data = N_data or batch
    grads = [
        torch.autograd.grad(logits, [o for _, _, o in calls], vectors[k], retain_graph=True)
        for k in range(S)
    ]
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[Tensor]] = {}
    for module in dict.fromkeys(m for m, _, _ in calls):
        idx = [i for i, (m, _, _) in enumerate(calls) if m is module]
        W = module.weight
        groups = getattr(module, "groups", 1)
        R, D = W.shape[0], W[0].numel()
        transposed = type(module) in TRANSPOSED
        F0 = torch.zeros(R, R, dtype=W.dtype)
        F1 = torch.zeros(D, D, dtype=W.dtype)
        bias_moment = 0
        for k in range(S):
            rs, cs, os_ = [], [], []
            for i in idx:
                r, c, o = _sides(module, calls[i][1].detach(), grads[k][i])
                rs.append(r), cs.append(c), os_.append(o)
            r, c, o = torch.cat(rs, 1), torch.cat(cs, 1), torch.cat(os_, 1)
            T = r.shape[1]
            # self-check: the sides reproduce the weight gradient of this draw
            full = torch.autograd.grad(logits, W, vectors[k], retain_graph=True)[0]
            rg = r.reshape(batch, T, groups, R // groups)
            cg = c.reshape(batch, T, groups, D)
            grad = torch.einsum("ntgr,ntgd->grd", rg, cg).reshape(W.shape)
            assert torch.allclose(grad, full, atol=1e-10), "reference sides are wrong"
            row_m = _moment(r, mode, mean=False)
            col_m = sum(_moment(cg[:, :, j], mode, mean=True) for j in range(groups))
            if transposed:
                F0 = row_m  # deterministic
                F1 = F1 + col_m / S
            else:
                F0 = F0 + row_m / S
                F1 = col_m
            bias_mode = "reduce" if bias_block == "exact" else mode
            bias_moment = bias_moment + _moment(o, bias_mode, mean=False) / S
        scale = groups * N_data * (T if mode == "expand" else 1)
        out[names[id(W)]] = [F0, F1 / scale]
        if module.bias is not None:
            out[names[id(module.bias)]] = [bias_moment]
    return out


def exact_blocks(model: nn.Module, x: Tensor, y: Tensor, loss) -> dict[str, Tensor]:
    """The exact GGN block ``Σ_n J_nᵀ H_n J_n`` of every parameter (dense Jacobian and Hessian)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = functional_call(model, params, (x,))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    H = loss_hessian_dense(lambda logits: loss.value(logits, y), f)
    out = {}
    for n in params:
        J = jac[n].reshape(f.numel(), -1)
        out[n] = J.T @ H @ J
    return out


def dense_entry(entry: list[Tensor]) -> Tensor:
    """The dense block of one ``Kron`` entry (``kron(F0, F1)`` or ``B``)."""
    if len(entry) == 1:
        return entry[0]
    return torch.kron(entry[0], entry[1])
