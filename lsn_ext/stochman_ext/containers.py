r"""The containers of the StochMan adapter: :class:`Sequential` and :class:`SkipConnection`.

Their diag→diag sandwiches are computed by the native engine (:class:`lsn_ext.engine.Session`),
which runs the container once with every registered layer as a node of the DB recursion: the
input sandwich ``D(J_xᵀ diag(m) J_x)`` arrives as the "gradient" of the input, the per-sample
weight sandwich as the "gradients" of detached copies of the parameters
(:func:`lsn_ext._functional.functional_call_all`; the module itself is not touched). Autograd's
fan-out sum at the concatenation is LSN Eq. (27),
``D(J_SCᵀ M J_SC) = D(J_Fᵀ M_F J_F) + M_x``.

:func:`check_network` is the structure these containers and
:func:`lsn_ext.stochman_ext.diag_backprop_nnj` accept (plain chains, skip connections and
registered layers, nested as needed), with an error that names the module and its path.
"""

from __future__ import annotations

from typing import Literal

import torch
from stochman import nnj
from torch import Tensor, nn

from lsn_ext._functional import functional_call_all
from lsn_ext.engine import Session
from lsn_ext.rules import RULES
from lsn_ext.stochman_ext.layers import as_output, unsupported

__all__ = [
    "Order",
    "Sequential",
    "SkipConnection",
    "check_network",
    "head_of",
    "is_chain",
    "is_skip",
    "join_path",
]

Order = Literal["skip-first", "layers-first"]

_SEQUENTIAL_FORWARDS = (nn.Sequential.forward, nnj.Sequential.forward)


def is_chain(module: nn.Module) -> bool:
    """An ``nn.Sequential`` / ``nnj.Sequential`` whose forward is the plain chain."""
    return isinstance(module, nn.Sequential) and type(module).forward in _SEQUENTIAL_FORWARDS


def is_skip(module: nn.Module) -> bool:
    """A :class:`SkipConnection` whose forward is the concatenation."""
    return isinstance(module, SkipConnection) and type(module).forward is SkipConnection.forward


def join_path(path: str, name: str) -> str:
    """``path.name``, or ``name`` at the top."""
    return f"{path}.{name}" if path else name


def check_network(module: nn.Module, path: str = "") -> None:
    """Refuse a module that is neither a plain chain, a :class:`SkipConnection` nor registered.

    Walks the network in the order its forward runs the modules: chains (:func:`is_chain`) and
    skip connections (:func:`is_skip`) recurse, every other module must have a rule in
    :data:`lsn_ext.rules.RULES`.

    Args:
        module: The network, or one of its modules.
        path: The dotted path of ``module`` in the network (for the message).

    Raises:
        NotImplementedError: Naming the first module without a rule and its path, how to
            register one, and the containers understood here (:func:`unsupported`).
    """
    if is_chain(module):
        for name, child in module.named_children():
            check_network(child, join_path(path, name))
    elif is_skip(module):
        check_network(module._F, join_path(path, "_F"))
    elif type(module) not in RULES:
        raise unsupported(module, path)


def head_of(model: nn.Module, path: str = "") -> tuple[nn.Module, str]:
    """The module whose output is the network's output (for the exact cross-entropy step)."""
    while is_chain(model) and len(model) > 0:
        name, model = list(model.named_children())[-1]
        path = join_path(path, name)
    return model, path or "<model>"


def _run(module: nn.Module, x: Tensor, tensors: dict[str, Tensor]) -> Tensor:
    """``module(x)`` with ``tensors`` as its parameters, as one DB pass of the native engine."""
    session = Session(module)
    with torch.enable_grad(), session:
        y = functional_call_all(module, tensors, (x,))
    session.check_graph(y, (x,))
    return y


def _container_sandwiches(
    module: nn.Module, x: Tensor, val: Tensor | None, tmp: Tensor, weight: bool
) -> Tensor | None:
    """The diag→diag sandwiches of a container by the engine (see :class:`_ContainerSandwich`)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{type(module).__name__}'s diag→diag sandwiches run the DB engine, which needs "
            "autograd; torch.inference_mode() switches it off even inside torch.enable_grad(). "
            "Call them outside the inference_mode block (torch.no_grad() is fine)"
        )
    check_network(module)
    # An inference tensor (made under inference_mode) cannot enter autograd: a normal copy can.
    x = x.detach().clone() if x.is_inference() else x.detach()
    named = list(module.named_parameters())
    if not weight:
        x = x.requires_grad_()
        y = _run(module, x, {n: p.detach() for n, p in named})
        m, flat = as_output(tmp, y.shape, type(module).__name__)
        (m_in,) = torch.autograd.grad(y, x, grad_outputs=m)
        return m_in.reshape(x.shape[0], -1) if flat else m_in
    if not named:
        return None
    rows = []
    for b in range(x.shape[0]):
        leaves = {n: p.detach().requires_grad_() for n, p in named}
        y = _run(module, x[b : b + 1], leaves)
        m, _ = as_output(tmp, (x.shape[0], *y.shape[1:]), type(module).__name__)
        diags = torch.autograd.grad(
            y, list(leaves.values()), grad_outputs=m[b : b + 1], allow_unused=True
        )
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if d is None else d).reshape(-1)
                    for (_, p), d in zip(named, diags, strict=True)
                ]
            )
        )
    return torch.stack(rows)


class _ContainerSandwich:
    """Mixin: diag→diag sandwiches of a container by the engine; other paths are not provided."""

    def _jacobian_wrt_input_sandwich(
        self, x: Tensor, val: Tensor, tmp: Tensor, diag_inp: bool = False, diag_out: bool = False
    ) -> Tensor:
        if not (diag_inp and diag_out):
            _no_full_path(self, "_jacobian_wrt_input_sandwich", diag_inp, diag_out)
        return _container_sandwiches(self, x, val, tmp, weight=False)

    def _jacobian_wrt_weight_sandwich(
        self, x: Tensor, val: Tensor, tmp: Tensor, diag_inp: bool = False, diag_out: bool = False
    ) -> Tensor | None:
        if not (diag_inp and diag_out):
            _no_full_path(self, "_jacobian_wrt_weight_sandwich", diag_inp, diag_out)
        return _container_sandwiches(self, x, val, tmp, weight=True)


def _no_full_path(module: nn.Module, name: str, diag_inp: bool, diag_out: bool) -> None:
    raise NotImplementedError(
        f"{type(module).__name__}.{name}(diag_inp={diag_inp}, diag_out={diag_out}): only the "
        "diag→diag sandwiches (diagonal backpropagation) are implemented for containers; "
        "StochMan 0.3.0's nnj.Sequential has no sandwiches at all"
    )


# Upstream fix (its sandwiches): integration/checks/upstream/stochman/0004-skip-connection.patch
class Sequential(_ContainerSandwich, nnj.Sequential):
    """``nnj.Sequential`` with the diag→diag sandwiches of the whole chain (LSN Alg. 3).

    For ``f = f_L ∘ … ∘ f_1``: ``m ← D(J_kᵀ diag(m) J_k)`` for ``k = L … 1`` gives the input
    sandwich; the weight sandwich concatenates each layer's ``D(J_θkᵀ diag(m_k) J_θk)`` in
    ``named_parameters`` order, per sample, ``[B, P]`` (``None`` without parameters). Each call
    runs the chain's forward once from ``x``. Layouts as in StochMan: ``tmp`` ``[B, prod(out)]``
    (or shaped like the output), the input sandwich ``[B, prod(in)]`` (or shaped like ``x``).

    It also chains StochMan's Jacobian products (:meth:`_jacobian_wrt_input_mult_left_vec`), so
    that it can sit inside an ``nnj.Sequential`` called with ``jacobian=True``; StochMan 0.3.0's
    own ``Sequential.forward(x, jacobian=tensor)`` fails (``if jacobian:`` on a tensor).
    """

    # Upstream fix: integration/checks/upstream/stochman/0003-sequential-jacobian-tensor.patch
    def _jacobian_wrt_input_mult_left_vec(
        self, x: Tensor, val: Tensor | None, jac_in: Tensor
    ) -> Tensor:
        """``J_L ⋯ J_1 · jac_in``, each factor by the layer's own StochMan method.

        Shapes: ``jac_in`` ``[B, *in, *rest]``, the result ``[B, *out, *rest]``.
        """
        for module in self:
            y = module(x)
            jac_in = module._jacobian_wrt_input_mult_left_vec(x, y, jac_in)
            x = y
        return jac_in


# Upstream fix: integration/checks/upstream/stochman/0004-skip-connection.patch
class SkipConnection(_ContainerSandwich, nnj.AbstractJacobian, nn.Module):
    r"""``SC(x) = cat([x, F(x)], dim)`` (or ``cat([F(x), x], dim)``), ``F`` a :class:`Sequential`.

    The skip connection of a U-Net level (LSN §3.2, appendix A.7). Its input Jacobian stacks the
    identity and ``J_F``, so with a diagonal ``M`` split along ``dim`` into ``M_x`` (the copy of
    ``x``) and ``M_F`` (the output of ``F``), LSN Eq. (27) gives

    .. math::

        \mathcal D(J_{SC}^\top M J_{SC}) = \mathcal D(J_F^\top M_F J_F) + \mathcal D(M_x),

    the first term by the recursive call on ``F`` (whose own skip connections recurse in turn);
    the weight sandwich is ``F``'s. Shapes: ``x`` ``[N, C, *]``; ``F(x)`` must match ``x`` in
    every dimension except ``dim``.

    Args:
        *layers: The layers of ``F`` (``nnj`` modules, nested :class:`SkipConnection` s).
        dim: The concatenation dimension (not the batch dimension); 1 (channels) by default.
        order: ``"skip-first"`` (``cat([x, F(x)])``, as in :class:`lsn_ext.models.UNet`) or
            ``"layers-first"`` (``cat([F(x), x])``).

    Raises:
        ValueError: For an unknown ``order``; in forward, for ``dim`` selecting the batch
            dimension or outside the input's dimensions, or ``F(x)`` not matching ``x``.
    """

    def __init__(self, *layers: nn.Module, dim: int = 1, order: Order = "skip-first"):
        super().__init__()
        if order not in ("skip-first", "layers-first"):
            raise ValueError(f"order must be 'skip-first' or 'layers-first', got {order!r}")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"dim must be an int, got {dim!r}")
        single = len(layers) == 1 and type(layers[0]) is Sequential
        self._F = layers[0] if single else Sequential(*layers)
        self.dim, self.order = dim, order

    def _cat_dim(self, x: Tensor) -> int:
        """``dim`` as a non-negative index for ``x``; never the batch dimension."""
        if not -x.dim() <= self.dim < x.dim() or self.dim % x.dim() == 0:
            raise ValueError(
                f"SkipConnection(dim={self.dim}) cannot concatenate an input of shape "
                f"{tuple(x.shape)} there: dim must be a non-batch dimension of the input"
            )
        return self.dim % x.dim()

    def _merge(self, x: Tensor, y_f: Tensor, dim: int) -> Tensor:
        if y_f.dim() != x.dim() or any(
            a != b for d, (a, b) in enumerate(zip(x.shape, y_f.shape, strict=True)) if d != dim
        ):
            raise ValueError(
                f"SkipConnection(dim={self.dim}): F(x) has shape {tuple(y_f.shape)} and x "
                f"{tuple(x.shape)}; they must agree in every dimension except {dim}"
            )
        return torch.cat([x, y_f] if self.order == "skip-first" else [y_f, x], dim)

    def forward(self, x: Tensor) -> Tensor:
        """``cat([x, F(x)], dim)`` for ``"skip-first"``, ``cat([F(x), x], dim)`` otherwise.

        Args:
            x: The input, e.g. ``[N, C, H, W]``.

        Returns:
            ``x`` and the branch's output ``F(x)`` concatenated along ``dim``, e.g.
            ``[N, C + C_F, H, W]``.
        """
        dim = self._cat_dim(x)
        return self._merge(x, self._F(x), dim)

    def _jacobian_wrt_input_mult_left_vec(self, x: Tensor, val: Tensor, jac_in: Tensor) -> Tensor:
        """``J_SC · jac_in = cat([jac_in, J_F · jac_in], dim)`` (StochMan's Jacobian layout)."""
        j_f = self._F._jacobian_wrt_input_mult_left_vec(x, None, jac_in)
        dim = self._cat_dim(x)
        return torch.cat([jac_in, j_f] if self.order == "skip-first" else [j_f, jac_in], dim)

    def extra_repr(self) -> str:
        """``dim`` and ``order``, shown in ``repr``.

        Returns:
            ``"dim=…, order=…"``.
        """
        return f"dim={self.dim}, order={self.order!r}"
