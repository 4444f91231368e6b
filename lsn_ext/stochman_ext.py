r"""StochMan ``nnj`` adapter: skip connections, the SSN mean head and diagonal sandwiches.

::

    from stochman import nnj
    from lsn_ext import stochman_ext as sx

    mean_net = nnj.Sequential(                        # the LSN "mean network"
        sx.Conv2d(3, 8, 3, padding=1), sx.Tanh(),
        sx.SkipConnection(sx.MaxPool2d(2), sx.Conv2d(8, 8, 3, padding=1), sx.Tanh(),
                          sx.Upsample(scale_factor=2)),          # cat([x, F(x)], dim=1)
        sx.Conv2d(16, 8, 3, padding=1), sx.Tanh(),
        sx.MeanHead(8, num_classes=2),
    )
    res = sx.diag_backprop_nnj(mean_net, x, y, "ce")  # .diagonals {name: diag}, .vector

    net = sx.to_nnj(lsn_ext.models.UNet(3, 2))        # nested SkipConnections, shared weights

Diagonal backpropagation (DB) needs, per module, the two StochMan "sandwiches" with a diagonal
``M`` in and out: ``D(J_xᵀ diag(m) J_x) = (J_x ∘ J_x)ᵀ m`` and ``D(J_θᵀ diag(m) J_θ)``. Every
leaf module here computes them by calling its rule from the rule table
(:data:`lsn_ext.rules.RULES`); no layer's maths is written twice. Containers recurse:

- :class:`Sequential` (and any ``nn.Sequential`` / ``nnj.Sequential`` inside a network) runs the
  DB chain of LSN Alg. 3: forward once, then ``m ← D(J_kᵀ diag(m) J_k)`` for ``k = L … 1``.
- :class:`SkipConnection` computes ``SC(x) = cat([x, F(x)], dim)``, ``J_SC = [I; J_F]``, and
  implements LSN Eq. (27): with ``m = (m_x, m_F)`` split along ``dim``,
  ``D(J_SCᵀ M J_SC) = D(J_Fᵀ M_F J_F) + M_x`` (input) and the parameter diagonals of ``F``
  alone (weights). ``F`` is a :class:`Sequential`, so nested skip connections recurse.

:func:`diag_backprop_nnj` runs a whole network: one forward pass, the loss Hessian diagonal
``as_loss(loss).hessian_diag`` (for cross-entropy by default the exact per-pixel block through
the head, ``rule.input_rule_block``), then the backward recursion. It agrees with the native
engine :func:`lsn_ext.diag_backprop` on an equivalent ``nn.Module`` to round-off: both take the
diagonal after every registered module, and concatenation, max pooling and nearest upsampling
are exact.

Registration. The rule table looks modules up by exact class. :func:`register` (run on import of
this module, idempotent) registers StochMan's own ``nnj`` classes whose ``forward`` computes what
their ``torch.nn`` parent computes, and the classes of this module, each with its parent's rule;
after that, the native engine, and so laplace-torch's ``DiagBackprop`` backend, run on ``nnj``
models directly: ``Laplace(nnj_model, ..., backend=lsn_ext.DiagBackprop)``. ``nnj`` classes with
another ``forward`` (``ArcTanh`` subclasses ``nn.Tanh``, ``PosLinear`` ``nn.Linear``) are not
registered.

What StochMan 0.3.0 forced on this adapter (measured):

- ``nnj.Sequential`` has no sandwich methods and StochMan no DB driver: :class:`Sequential` and
  :func:`diag_backprop_nnj` provide them; there is no ``SkipConnection`` at all.
- Layout. ``tmp`` of a diag→diag sandwich is flattened per sample, ``[B, prod(out_shape)]``,
  and the input sandwich returns ``[B, prod(in_shape)]``; the weight sandwich returns
  **per-sample** diagonals ``[B, P]`` (weight flattened, then bias), ``None`` for layers without
  parameters. The methods here keep that contract (and also accept ``tmp`` shaped like the
  output, then answer shaped like the input); per-sample weight diagonals cost one rule call per
  sample, so the network driver sums over the batch inside the rules instead.
- ``nnj.Upsample``'s diag→diag sandwich convolves with a ``ones(C, C, s, s)`` kernel: it sums
  over all channels (wrong for ``C > 1``), treats every mode as nearest (wrong for bilinear even
  with ``C = 1``), allows integer scale factors only, and builds the kernel in the *default*
  dtype (a float64 model under float32 default fails). :class:`Upsample` uses
  :class:`~lsn_ext.rules.UpsampleRule`: exact for any channel count, mode and dtype.
- ``nnj.Conv2d``'s diag sandwiches fail for strides that drop input rows (``output_padding=0``)
  and its weight sandwich for any stride > 1; it accumulates in the default dtype. :class:`Conv2d`
  uses :class:`~lsn_ext.rules.ConvRule` (any stride, padding, dilation, groups).
- Only the diag→diag paths are replaced. Full→full and the mixed paths stay StochMan's where it
  has them (``Linear``, ``Conv2d``, ``MaxPool2d``, ``Tanh``, ``Reshape``, ``Flatten``; nearest,
  integer-scale, default-dtype ``Upsample``) and raise ``NotImplementedError`` elsewhere; DB uses
  diag→diag only.
- ``nnj.MaxPool*d.forward`` stores the pooling indices on the module (``self.idx``); the rules
  do not use them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from stochman import nnj
from torch import Tensor, nn

from lsn_ext.engine import DiagBackpropResult
from lsn_ext.models import UNet
from lsn_ext.rules import (
    RULES,
    BatchNormRule,
    ConvRule,
    ELURule,
    LeakyReLURule,
    LinearRule,
    ReLURule,
    Rule,
    SigmoidRule,
    SoftmaxRule,
    SoftplusRule,
    StructuralRule,
    TanhRule,
    UpsampleRule,
    get_rule,
    register_rule,
)
from lsn_ext.rules.losses import CrossEntropy, Loss, as_loss

__all__ = [
    "ELU",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Flatten",
    "Identity",
    "LeakyReLU",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MeanHead",
    "ReLU",
    "Reshape",
    "Sequential",
    "Sigmoid",
    "SkipConnection",
    "Softplus",
    "Tanh",
    "Upsample",
    "diag_backprop_nnj",
    "register",
    "to_nnj",
]

Order = Literal["skip-first", "layers-first"]


# -- diag→diag sandwiches of single layers, from the rule table ----------------------------------


def _rule(module: nn.Module) -> Rule:
    """The registered rule of a leaf module, or the error that says what to do."""
    rule = RULES.get(type(module))
    if rule is None:
        raise _unsupported(module, "")
    return rule


def _as_output(tmp: Tensor, shape: torch.Size, where: str) -> tuple[Tensor, bool]:
    """``tmp`` reshaped to the output ``shape``, and whether it came flattened per sample.

    Accepted: ``[B, prod(shape[1:])]`` (StochMan's layout; answered flattened too) or ``shape``
    (answered shaped like the input). For 2-D outputs the two agree and StochMan's layout wins.
    """
    shape = torch.Size(shape)
    per_sample = shape[1:].numel()
    if tmp.shape == (shape[0], per_sample):
        return tmp.reshape(shape), True
    if tmp.shape == shape:
        return tmp, False
    raise ValueError(
        f"{where}: the diagonal tmp has shape {tuple(tmp.shape)}, but the output is "
        f"{tuple(shape)}; give it flattened per sample, [{shape[0]}, {per_sample}], or shaped "
        "like the output"
    )


def _stochman_path(
    parent: Any, module: nn.Module, name: str, args: tuple, diag_inp: bool, diag_out: bool
) -> Tensor | None:
    """Delegate a non-diag→diag sandwich to StochMan, or say that it has none."""
    method = getattr(parent, name, None)
    if method is None:
        raise NotImplementedError(
            f"{type(module).__name__}.{name}(diag_inp={diag_inp}, diag_out={diag_out}): StochMan "
            f"0.3.0 has no such path for nnj.{_nnj_base(module).__name__}, and lsn_ext "
            "implements the diag→diag sandwiches (diagonal backpropagation) only"
        )
    return method(*args, diag_inp=diag_inp, diag_out=diag_out)


def _nnj_base(module: nn.Module) -> type:
    """The StochMan class that ``module``'s class extends."""
    return next(c for c in type(module).__mro__ if c.__module__ == nnj.__name__)


def _leaf_input_sandwich(module: nn.Module, x: Tensor, val: Tensor | None, tmp: Tensor) -> Tensor:
    """``(J_x ∘ J_x)ᵀ m`` of one layer by its rule; the layout of ``tmp`` is kept."""
    with torch.no_grad():
        val = module(x) if val is None else val
        m, flat = _as_output(tmp, val.shape, type(module).__name__)
        m_in, _ = _rule(module).backward(module, x.detach(), val.detach(), m, True, False)
    return m_in.reshape(x.shape[0], -1) if flat else m_in


def _leaf_weight_sandwich(
    module: nn.Module, x: Tensor, val: Tensor | None, tmp: Tensor
) -> Tensor | None:
    """Per-sample ``(J_θ ∘ J_θ)ᵀ m_b`` of one layer by its rule: ``[B, P]``, or ``None``."""
    names = [n for n, p in module.named_parameters(recurse=False)]
    if not names:
        return None
    rule = _rule(module)
    with torch.no_grad():
        val = module(x) if val is None else val
        m, _ = _as_output(tmp, val.shape, type(module).__name__)
        x, val = x.detach(), val.detach()
        rows = []
        for b in range(x.shape[0]):
            _, d = rule.backward(module, x[b : b + 1], val[b : b + 1], m[b : b + 1], False, True)
            rows.append(torch.cat([d[n].reshape(-1) for n in names]))
    return torch.stack(rows)


class _DiagSandwich:
    """Mixin: the diag→diag sandwiches of a layer from its rule; other paths are StochMan's.

    Shapes (StochMan's contract): ``x`` ``[B, *in]``, ``val`` ``[B, *out]``, ``tmp`` the
    diagonal of ``M`` w.r.t. the output, ``[B, prod(out)]`` (or ``[B, *out]``). The input sandwich
    returns ``(J_x ∘ J_x)ᵀ tmp`` as ``[B, prod(in)]`` (or ``[B, *in]``), the weight sandwich the
    per-sample ``(J_θ ∘ J_θ)ᵀ tmp_b`` as ``[B, P]``, the module's parameters flattened and
    concatenated in ``named_parameters`` order (weight, then bias), or ``None`` without
    parameters.
    """

    def _jacobian_wrt_input_sandwich(
        self, x: Tensor, val: Tensor, tmp: Tensor, diag_inp: bool = False, diag_out: bool = False
    ) -> Tensor:
        if diag_inp and diag_out:
            return _leaf_input_sandwich(self, x, val, tmp)
        name = "_jacobian_wrt_input_sandwich"
        return _stochman_path(super(), self, name, (x, val, tmp), diag_inp, diag_out)

    def _jacobian_wrt_weight_sandwich(
        self, x: Tensor, val: Tensor, tmp: Tensor, diag_inp: bool = False, diag_out: bool = False
    ) -> Tensor | None:
        if diag_inp and diag_out:
            return _leaf_weight_sandwich(self, x, val, tmp)
        if not any(True for _ in self.parameters(recurse=False)):
            return None
        name = "_jacobian_wrt_weight_sandwich"
        return _stochman_path(super(), self, name, (x, val, tmp), diag_inp, diag_out)


class Identity(_DiagSandwich, nnj.Identity):
    """``nnj.Identity``; DB by :class:`~lsn_ext.rules.StructuralRule` (``m_in = m``)."""


class Linear(_DiagSandwich, nnj.Linear):
    """``nnj.Linear``; DB by :class:`~lsn_ext.rules.LinearRule` (``m_in = m (W∘W)``)."""


class Conv1d(_DiagSandwich, nnj.Conv1d):
    """``nnj.Conv1d``; DB by :class:`~lsn_ext.rules.ConvRule`."""


# Upstream fix: integration/upstream/stochman/0002-conv2d-sandwich-stride.patch
class Conv2d(_DiagSandwich, nnj.Conv2d):
    """``nnj.Conv2d``; DB by :class:`~lsn_ext.rules.ConvRule` (any stride, padding, groups)."""


class Conv3d(_DiagSandwich, nnj.Conv3d):
    """``nnj.Conv3d``; DB by :class:`~lsn_ext.rules.ConvRule`."""


class ConvTranspose1d(_DiagSandwich, nnj.ConvTranspose1d):
    """``nnj.ConvTranspose1d``; DB by :class:`~lsn_ext.rules.ConvRule`."""


class ConvTranspose2d(_DiagSandwich, nnj.ConvTranspose2d):
    """``nnj.ConvTranspose2d``; DB by :class:`~lsn_ext.rules.ConvRule`."""


class ConvTranspose3d(_DiagSandwich, nnj.ConvTranspose3d):
    """``nnj.ConvTranspose3d``; DB by :class:`~lsn_ext.rules.ConvRule`."""


# Upstream fix: integration/upstream/stochman/0001-upsample-sandwich-per-channel.patch
class Upsample(_DiagSandwich, nnj.Upsample):
    """``nnj.Upsample`` with a correct diag→diag sandwich (:class:`~lsn_ext.rules.UpsampleRule`).

    ``m_in[n, c] = Σ_o Π_d A_d[o_d, i_d]² m_out[n, c, o]`` with the per-axis interpolation
    matrices ``A_d``: channels are never mixed, every mode and scale factor is exact, in the dtype
    of the input. (StochMan's own diag sandwich sums over channels and assumes nearest mode.)
    """


class MaxPool1d(_DiagSandwich, nnj.MaxPool1d):
    """``nnj.MaxPool1d``; DB by :class:`~lsn_ext.rules.StructuralRule` (a 0/1 Jacobian)."""


class MaxPool2d(_DiagSandwich, nnj.MaxPool2d):
    """``nnj.MaxPool2d``; DB by :class:`~lsn_ext.rules.StructuralRule` (a 0/1 Jacobian)."""


class MaxPool3d(_DiagSandwich, nnj.MaxPool3d):
    """``nnj.MaxPool3d``; DB by :class:`~lsn_ext.rules.StructuralRule` (a 0/1 Jacobian)."""


class Flatten(_DiagSandwich, nnj.Flatten):
    """``nnj.Flatten`` (``[B, *] → [B, prod(*)]``); DB by :class:`~lsn_ext.rules.StructuralRule`."""


class Reshape(_DiagSandwich, nnj.Reshape):
    """``nnj.Reshape(*dims)`` (``[B, *] → [B, *dims]``); DB by ``StructuralRule``."""


class Tanh(_DiagSandwich, nnj.Tanh):
    """``nnj.Tanh``; DB by :class:`~lsn_ext.rules.TanhRule` (``m_in = (1 − y²)² m``)."""


class Sigmoid(_DiagSandwich, nnj.Sigmoid):
    """``nnj.Sigmoid``; DB by :class:`~lsn_ext.rules.SigmoidRule` (``m_in = (y(1 − y))² m``)."""


class ReLU(_DiagSandwich, nnj.ReLU):
    """``nnj.ReLU``; DB by :class:`~lsn_ext.rules.ReLURule` (``m_in = 1[x > 0] m``)."""


class LeakyReLU(_DiagSandwich, nnj.LeakyReLU):
    """``nnj.LeakyReLU``; DB by :class:`~lsn_ext.rules.LeakyReLURule`."""


class ELU(_DiagSandwich, nnj.ELU):
    """``nnj.ELU``; DB by :class:`~lsn_ext.rules.ELURule`."""


class Softplus(_DiagSandwich, nnj.Softplus):
    """``nnj.Softplus``; DB by :class:`~lsn_ext.rules.SoftplusRule`."""


class BatchNorm1d(_DiagSandwich, nnj.BatchNorm1d):
    """``nnj.BatchNorm1d`` in evaluation mode; DB by :class:`~lsn_ext.rules.BatchNormRule`."""


class BatchNorm2d(_DiagSandwich, nnj.BatchNorm2d):
    """``nnj.BatchNorm2d`` in evaluation mode; DB by :class:`~lsn_ext.rules.BatchNormRule`."""


class BatchNorm3d(_DiagSandwich, nnj.BatchNorm3d):
    """``nnj.BatchNorm3d`` in evaluation mode; DB by :class:`~lsn_ext.rules.BatchNormRule`."""


class MeanHead(Conv2d):
    """The SSN mean head: a 1×1 :class:`Conv2d` from the backbone's features to the logit mean.

    ``μ(x) = W ∗ h + b`` with ``h`` ``[N, in_channels, H, W]`` and ``μ`` ``[N, num_classes, H, W]``
    (SSN, Monteiro et al. 2020; LSN Eq. 7). ``nnj.Sequential(backbone, MeanHead(c, k))`` is the
    LSN mean network, whose Laplace approximation LSN computes (LSN Eq. 12). As the last layer it
    carries the exact cross-entropy first step (``ConvRule.input_rule_block``).

    Args:
        in_channels: Feature maps of the backbone's output.
        num_classes: Logit channels (1 for binary segmentation with BCE).
        bias: Whether the head has a bias.
    """

    def __init__(self, in_channels: int, num_classes: int, bias: bool = True):
        super().__init__(in_channels, num_classes, kernel_size=1, bias=bias)


# -- containers: the DB chain and LSN Eq. (27) ---------------------------------------------------

_SEQUENTIAL_FORWARDS = (nn.Sequential.forward, nnj.Sequential.forward)


def _is_chain(module: nn.Module) -> bool:
    """An ``nn.Sequential`` / ``nnj.Sequential`` whose forward is the plain chain."""
    return isinstance(module, nn.Sequential) and type(module).forward in _SEQUENTIAL_FORWARDS


def _is_skip(module: nn.Module) -> bool:
    return isinstance(module, SkipConnection) and type(module).forward is SkipConnection.forward


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _unsupported(module: nn.Module, path: str) -> NotImplementedError:
    """The rule table's error for ``module``, plus the containers this driver understands."""
    try:
        get_rule(module, path)
    except NotImplementedError as err:
        return NotImplementedError(
            f"{err} Containers understood in StochMan networks: nn.Sequential / nnj.Sequential "
            "(unchanged forward) and lsn_ext.stochman_ext.SkipConnection; for arbitrary forward "
            "code use the native engine, lsn_ext.diag_backprop."
        )
    raise AssertionError(f"{type(module).__qualname__} has a rule")  # callers check RULES first


class _Pass:
    """One DB pass over an ``nnj`` network: forward with a record, then the backward recursion.

    The forward pushes what each leaf's rule needs (its input and output) and what each skip
    connection needs (the split) on one stack; the backward recursion visits the modules in
    exactly the reverse order and pops. Parameter diagonals are summed per parameter object
    (``id``), over the batch and over repeated uses of a module.

    Args:
        wanted: ``id`` s of the parameters whose diagonals are wanted.
    """

    def __init__(self, wanted: set[int]):
        self.wanted = wanted
        self.stack: list[tuple[nn.Module, Any]] = []
        self.diagonals: dict[int, Tensor] = {}
        self._wants: dict[int, bool] = {}

    def forward(self, module: nn.Module, x: Tensor, path: str) -> Tensor:
        if _is_chain(module):
            for name, child in module.named_children():
                x = self.forward(child, x, _join(path, name))
            return x
        if _is_skip(module):
            dim = module._cat_dim(x)
            y_f = self.forward(module._F, x, _join(path, "_F"))
            self.stack.append((module, (dim, x.shape[dim])))
            return module._merge(x, y_f, dim)
        rule = RULES.get(type(module))
        if rule is None:
            raise _unsupported(module, path)
        try:
            rule.check(module)
        except ValueError as err:
            raise ValueError(f"'{path}' ({type(module).__name__}): {err}") from None
        # An in-place layer must not overwrite its input, the previous layer's output record.
        y = module(x.clone() if getattr(module, "inplace", False) else x)
        if not isinstance(y, Tensor):
            raise TypeError(
                f"'{path}' ({type(module).__name__}) returned {type(y).__name__}; every layer of "
                "an nnj network must return one tensor"
            )
        self.stack.append((module, (x, y)))
        return y

    def wants(self, module: nn.Module) -> bool:
        """Whether a wanted parameter lives in ``module`` (cached)."""
        key = id(module)
        if key not in self._wants:
            self._wants[key] = any(id(p) in self.wanted for p in module.parameters())
        return self._wants[key]

    def _pop(self, module: nn.Module) -> Any:
        owner, record = self.stack.pop()
        if owner is not module:  # pragma: no cover - an internal invariant
            raise RuntimeError("the DB backward pass lost track of the forward records")
        return record

    def backward(
        self, module: nn.Module, m: Tensor | None, need_input: bool, block: Tensor | None = None
    ) -> Tensor | None:
        """``D(J_xᵀ diag(m) J_x)`` of ``module`` if ``need_input``; accumulates parameter diags.

        ``block`` (``[N, C, C, *]``) replaces ``diag(m)`` by the per-position block for the input
        step of the module that produced the output (the exact cross-entropy first step).
        """
        if _is_chain(module):
            children = list(module.children())
            for k in range(len(children) - 1, -1, -1):
                need = need_input or any(self.wants(c) for c in children[:k])
                m = self.backward(children[k], m, need, block if k == len(children) - 1 else None)
            return m if need_input else None
        if _is_skip(module):
            dim, n_x = self._pop(module)
            if m is None:  # nothing wanted below: keep the records in step only
                self.backward(module._F, None, False)
                return None
            n_f = m.shape[dim] - n_x
            if module.order == "skip-first":
                m_x, m_f = m.split([n_x, n_f], dim)
            else:
                m_f, m_x = m.split([n_f, n_x], dim)
            m_in = self.backward(module._F, m_f, need_input)
            return m_in + m_x if need_input else None
        x, y = self._pop(module)
        rule = RULES[type(module)]
        own = [
            (n, p) for n, p in module._parameters.items() if p is not None and id(p) in self.wanted
        ]
        if not (need_input or own):
            return None
        if block is not None:
            m_in = rule.input_rule_block(module, x, y, block) if need_input else None
            _, diags = rule.backward(module, x, y, m, False, bool(own))
        else:
            m_in, diags = rule.backward(module, x, y, m, need_input, bool(own))
        for name, p in own:
            previous = self.diagonals.get(id(p))
            self.diagonals[id(p)] = diags[name] if previous is None else previous + diags[name]
        return m_in


def _head(model: nn.Module, path: str = "") -> tuple[nn.Module, str]:
    """The module whose output is the network's output (for the exact cross-entropy step)."""
    while _is_chain(model) and len(model) > 0:
        name, model = list(model.named_children())[-1]
        path = _join(path, name)
    return model, path or "<model>"


def _container_sandwiches(
    module: nn.Module, x: Tensor, val: Tensor | None, tmp: Tensor, weight: bool
) -> Tensor | None:
    """The diag→diag sandwiches of a container by the DB recursion (see :class:`_DiagSandwich`)."""
    with torch.no_grad():
        x = x.detach()
        if not weight:
            run = _Pass(set())
            y = run.forward(module, x, "")
            m, flat = _as_output(tmp, y.shape, type(module).__name__)
            m_in = run.backward(module, m, need_input=True)
            return m_in.reshape(x.shape[0], -1) if flat else m_in
        params = list(module.parameters())
        if not params:
            return None
        rows = []
        for b in range(x.shape[0]):
            run = _Pass({id(p) for p in params})
            y = run.forward(module, x[b : b + 1], "")
            m, _ = _as_output(tmp, (x.shape[0], *y.shape[1:]), type(module).__name__)
            run.backward(module, m[b : b + 1], need_input=False)
            rows.append(
                torch.cat(
                    [run.diagonals.get(id(p), torch.zeros_like(p)).reshape(-1) for p in params]
                )
            )
        return torch.stack(rows)


class _ContainerSandwich:
    """Mixin: diag→diag sandwiches of a container by recursion; other paths are not provided."""

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


# Upstream fix (Sequential sandwiches): integration/upstream/stochman/0004-skip-connection.patch
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

    # Upstream fix: integration/upstream/stochman/0003-sequential-jacobian-tensor.patch
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


# Upstream fix: integration/upstream/stochman/0004-skip-connection.patch
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
        """``cat([x, F(x)], dim)`` for ``"skip-first"``, ``cat([F(x), x], dim)`` otherwise."""
        dim = self._cat_dim(x)
        return self._merge(x, self._F(x), dim)

    def _jacobian_wrt_input_mult_left_vec(self, x: Tensor, val: Tensor, jac_in: Tensor) -> Tensor:
        """``J_SC · jac_in = cat([jac_in, J_F · jac_in], dim)`` (StochMan's Jacobian layout)."""
        j_f = self._F._jacobian_wrt_input_mult_left_vec(x, None, jac_in)
        dim = self._cat_dim(x)
        return torch.cat([jac_in, j_f] if self.order == "skip-first" else [j_f, jac_in], dim)

    def extra_repr(self) -> str:
        """``dim`` and ``order``, shown in ``repr``."""
        return f"dim={self.dim}, order={self.order!r}"


# -- registration ---------------------------------------------------------------------------------

_RULE_CLASSES: dict[type[nn.Module], type[Rule]] = {
    # StochMan's classes whose forward is their torch.nn parent's (MaxPool*d: the same values).
    nnj.Identity: StructuralRule,
    nnj.Linear: LinearRule,
    nnj.Conv1d: ConvRule,
    nnj.Conv2d: ConvRule,
    nnj.Conv3d: ConvRule,
    nnj.ConvTranspose1d: ConvRule,
    nnj.ConvTranspose2d: ConvRule,
    nnj.ConvTranspose3d: ConvRule,
    nnj.Upsample: UpsampleRule,
    nnj.MaxPool1d: StructuralRule,
    nnj.MaxPool2d: StructuralRule,
    nnj.MaxPool3d: StructuralRule,
    nnj.Flatten: StructuralRule,
    nnj.Reshape: StructuralRule,
    nnj.Tanh: TanhRule,
    nnj.Sigmoid: SigmoidRule,
    nnj.ReLU: ReLURule,
    nnj.LeakyReLU: LeakyReLURule,
    nnj.ELU: ELURule,
    nnj.Softplus: SoftplusRule,
    nnj.Softmax: SoftmaxRule,
    nnj.BatchNorm1d: BatchNormRule,
    nnj.BatchNorm2d: BatchNormRule,
    nnj.BatchNorm3d: BatchNormRule,
}
# This module's subclasses (and MeanHead) take the rule of the nnj class they extend.
_RULE_CLASSES.update(
    {
        cls: _RULE_CLASSES[next(b for b in cls.__mro__ if b in _RULE_CLASSES)]
        for cls in (
            Identity, Linear, Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d,
            ConvTranspose3d, Upsample, MaxPool1d, MaxPool2d, MaxPool3d, Flatten, Reshape, Tanh,
            Sigmoid, ReLU, LeakyReLU, ELU, Softplus, BatchNorm1d, BatchNorm2d, BatchNorm3d,
            MeanHead,
        )
    }
)  # fmt: skip


def register(*, override: bool = False) -> list[type[nn.Module]]:
    """Register StochMan's ``nnj`` layers and this module's classes in the rule table.

    Each class gets the rule of its ``torch.nn`` parent (``nnj.Conv2d`` → ``ConvRule``,
    ``nnj.Tanh`` → ``TanhRule``, ``nnj.MaxPool2d`` / ``nnj.Flatten`` / ``nnj.Reshape`` →
    ``StructuralRule``, …), through :func:`lsn_ext.register_rule`; only classes whose ``forward``
    computes what that rule describes are listed. Run on import of this module; idempotent.
    Afterwards the native engine (:func:`lsn_ext.diag_backprop`), laplace-torch's
    ``DiagBackprop`` backend and the BackPACK adapter accept ``nnj`` networks.

    Args:
        override: Replace rules already registered for these classes (by default a class that
            has a rule keeps it, e.g. one the user registered).

    Returns:
        The classes newly registered (or replaced) by this call.
    """
    done = []
    for cls, rule_cls in _RULE_CLASSES.items():
        if cls in RULES and not override:
            continue
        register_rule(cls, rule_cls(), override=override)
        done.append(cls)
    return done


register()


# -- the network driver ---------------------------------------------------------------------------


def diag_backprop_nnj(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss: str | Loss | nn.Module = "ce",
    *,
    ce_first_step: Literal["exact", "diag"] = "exact",
    params: Sequence[Tensor] | None = None,
) -> DiagBackpropResult:
    """Diagonal backpropagation of the GGN through a StochMan ``nnj`` network, for one batch.

    Computes ``Σ_n D(J_nᵀ H_n J_n)`` with ``D`` after every layer (LSN Eq. 22) by the recursion
    of LSN appendix A.7: ``m = diag(H)`` at the logits, then for each module in reverse
    ``d_θ += (J_θ ∘ J_θ)ᵀ m`` and ``m ← (J_x ∘ J_x)ᵀ m`` from its rule, Eq. (27) at skip
    connections. For cross-entropy, ``ce_first_step="exact"`` sends the full per-position block
    ``diag(p) − p pᵀ`` through the head (``m = D(J_headᵀ H J_head)``), as the native engine does.
    Equals :func:`lsn_ext.diag_backprop` on the same or an equivalent ``nn.Module`` to round-off.

    Args:
        model: An ``nnj.Sequential`` / :class:`Sequential` / ``nn.Sequential`` of registered
            layers and :class:`SkipConnection` s (nested as needed), or one such module.
        inputs: The input ``[N, *]``.
        targets: Targets for ``loss`` (class indices ``[N, *]`` for cross-entropy).
        loss: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a ``torch.nn`` loss
            (see :func:`~lsn_ext.rules.losses.as_loss`), summed over the batch by default.
        ce_first_step: ``"exact"`` or ``"diag"`` (cross-entropy only), see
            :func:`lsn_ext.diag_backprop`.
        params: Parameters to return diagonals for; default: all with ``requires_grad``.

    Returns:
        The loss, the logits and ``{name: diagonal}`` in ``model.named_parameters()`` order
        (``.vector`` concatenates them), as :class:`lsn_ext.DiagBackpropResult`.

    Raises:
        NotImplementedError: A module without a rule, or a container whose forward is not a
            plain chain or a :class:`SkipConnection`; the message names it and its path.
        ValueError: Bad arguments, shapes or targets; a layer in a mode without a valid rule
            (dropout or batch norm in training mode); the exact cross-entropy step with logits
            that are not the output of a ``Linear`` or convolution.
        FloatingPointError: A non-finite diagonal (overflow).
    """
    loss_fn = as_loss(loss)
    if ce_first_step not in ("exact", "diag"):
        raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
    if not isinstance(inputs, Tensor):
        raise TypeError(f"nnj networks take one tensor input, got {type(inputs).__name__}")
    named = _select(model, params)
    exact_ce = isinstance(loss_fn, CrossEntropy) and ce_first_step == "exact"
    if exact_ce:
        head, path = _head(model)
        if _is_skip(head) or not (type(head) in RULES and RULES[type(head)].has_block_rule()):
            raise ValueError(
                "the exact cross-entropy first step needs the logits to be the direct output of "
                f"a Linear or convolution module (e.g. MeanHead), but they come from '{path}' "
                f"({type(head).__name__}). End the network with the head, or pass "
                "ce_first_step='diag' (starts from diag(H), which overestimates the curvature)"
            )

    run = _Pass({id(p) for _, p in named})
    with torch.no_grad():
        logits = run.forward(model, inputs, "")
        value = loss_fn.value(logits, targets)
        # The engine's power-of-two scale: keeps m out of the subnormal range (exact to undo).
        scale = 2.0 ** (math.frexp(torch.finfo(logits.dtype).max)[1] // 4)
        m = loss_fn.hessian_diag(logits, targets).contiguous() * scale
        block = loss_fn.hessian_block(logits, targets) * scale if exact_ce else None
        run.backward(model, m, need_input=False, block=block)
    diagonals = {
        n: run.diagonals[id(p)] / scale if id(p) in run.diagonals else torch.zeros_like(p)
        for n, p in named
    }
    bad = next((n for n, d in diagonals.items() if not torch.isfinite(d).all()), None)
    if bad is not None:
        raise FloatingPointError(
            f"the DB diagonal of '{bad}' is not finite (overflow in {logits.dtype}); check the "
            "inputs and weights for extreme values, or compute in float64"
        )
    return DiagBackpropResult(loss=value.detach(), logits=logits, diagonals=diagonals)


def _select(model: nn.Module, params: Sequence[Tensor] | None) -> list[tuple[str, Tensor]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if params is None:
        if not named:
            raise ValueError("the model has no parameter with requires_grad=True")
        return named
    wanted = {id(p) for p in params}
    if not wanted <= {id(p) for p in model.parameters()}:
        raise ValueError("params contains tensors that are not parameters of the model")
    chosen = [(n, p) for n, p in named if id(p) in wanted]
    if len(chosen) != len(wanted):
        raise ValueError("every parameter in params must have requires_grad=True")
    return chosen


# -- converting lsn_ext.models.UNet ---------------------------------------------------------------


def _share(new: nn.Module, old: nn.Module) -> nn.Module:
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    return new


_CONVERTERS: dict[type[nn.Module], Callable[[Any], nn.Module]] = {
    nn.Conv2d: lambda m: _share(
        Conv2d(
            m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
            m.groups, m.bias is not None, m.padding_mode,
        ),
        m,
    ),
    nn.ConvTranspose2d: lambda m: _share(
        ConvTranspose2d(
            m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.output_padding,
            m.groups, m.bias is not None, m.dilation, m.padding_mode,
        ),
        m,
    ),
    nn.MaxPool2d: lambda m: MaxPool2d(
        m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode
    ),
    nn.Upsample: lambda m: Upsample(
        m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor
    ),
    nn.Tanh: lambda m: Tanh(),
    nn.Sigmoid: lambda m: Sigmoid(),
    nn.ReLU: lambda m: ReLU(m.inplace),
    nn.LeakyReLU: lambda m: LeakyReLU(m.negative_slope, m.inplace),
    nn.ELU: lambda m: ELU(m.alpha, m.inplace),
    nn.Softplus: lambda m: Softplus(m.beta, m.threshold),
    nn.Dropout2d: lambda m: nn.Dropout2d(m.p),
}  # fmt: skip


def _convert(module: nn.Module, path: str) -> nn.Module:
    if type(module) is nn.Sequential:
        return Sequential(*(_convert(c, _join(path, n)) for n, c in module.named_children()))
    try:
        convert = _CONVERTERS[type(module)]
    except KeyError:
        raise TypeError(
            f"to_nnj cannot convert '{path}' ({type(module).__name__}); it converts "
            f"{', '.join(c.__name__ for c in _CONVERTERS)} and nn.Sequential"
        ) from None
    return convert(module).train(module.training)


def to_nnj(unet: UNet) -> Sequential:
    """The nnj form of an :class:`lsn_ext.models.UNet`, sharing its parameters.

    With encoder blocks ``E_l``, pools ``P_l``, upsamplings ``U_l`` and decoder blocks ``D_l``
    (level ``l = 0`` at full resolution, ``L`` levels), the U-Net is nested skip connections::

        S_{L-2} = SkipConnection(P_{L-2}, E_{L-1}, U_{L-2})
        S_l     = SkipConnection(P_l, E_{l+1}, S_{l+1}, D_{l+1}, U_l)        (l < L − 2)
        net     = Sequential(Sequential(E_0, S_0, D_0), MeanHead)

    so that ``net`` = ``Sequential(backbone, mean_head)``, the LSN mean network, computes
    ``unet(x)`` exactly. The parameter *objects* are shared (training one trains the other;
    ``copy.deepcopy`` the result for an independent copy), so diagonals can be matched by
    parameter identity.

    Args:
        unet: The U-Net. Its ``head`` must be the 1×1 convolution it builds.

    Returns:
        ``Sequential(backbone, MeanHead)``.

    Raises:
        TypeError: If ``unet`` is not a :class:`~lsn_ext.models.UNet`, or contains a layer this
            converter does not know (the message names it).
    """
    if not isinstance(unet, UNet):
        raise TypeError(f"to_nnj converts lsn_ext.models.UNet, got {type(unet).__name__}")
    levels = len(unet.widths)
    enc = [_convert(e, f"encoders.{i}") for i, e in enumerate(unet.encoders)]
    pools = [_convert(p, f"pools.{i}") for i, p in enumerate(unet.pools)]
    # ups / decoders are stored from the bottleneck upwards: index j serves level L − 2 − j.
    ups = {levels - 2 - j: _convert(u, f"ups.{j}") for j, u in enumerate(unet.ups)}
    dec = {levels - 2 - j: _convert(d, f"decoders.{j}") for j, d in enumerate(unet.decoders)}
    inner: SkipConnection | None = None
    for level in range(levels - 2, -1, -1):
        layers = [pools[level], enc[level + 1]]
        if inner is not None:
            layers += [inner, dec[level + 1]]
        inner = SkipConnection(*layers, ups[level], dim=1, order="skip-first")
    backbone = Sequential(enc[0]) if inner is None else Sequential(enc[0], inner, dec[0])
    head = unet.head
    mean_head = _share(MeanHead(head.in_channels, head.out_channels, head.bias is not None), head)
    return Sequential(backbone, mean_head).train(unet.training)
