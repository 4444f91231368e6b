"""The leaf layers of the StochMan adapter and their registration in the rule table.

Each class here is a StochMan ``nnj`` layer whose diag→diag sandwiches (the two that diagonal
backpropagation needs, ``D(J_xᵀ diag(m) J_x) = (J_x ∘ J_x)ᵀ m`` and ``D(J_θᵀ diag(m) J_θ)``) call
the layer's rule from :data:`lsn_ext.rules.RULES`; the other sandwich paths stay StochMan's (see
:mod:`lsn_ext.stochman_ext` for what StochMan 0.3.0 gets wrong and why). :data:`SAME_FORWARD`
lists the ``nnj`` classes and the classes of this package whose ``forward`` computes what their
``torch.nn`` parent's does, and :func:`register` gives each the rule registered for that parent
(run on import of the package).
"""

from __future__ import annotations

from typing import Any

import torch
from stochman import nnj
from torch import Tensor, nn

from lsn_ext.rules import RULES, Rule, get_rule, register_rule

__all__ = [
    "ELU",
    "SAME_FORWARD",
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
    "Sigmoid",
    "Softplus",
    "Tanh",
    "Upsample",
    "as_output",
    "register",
    "torch_parent",
    "unsupported",
]

# -- diag→diag sandwiches of single layers, from the rule table ----------------------------------


def _rule(module: nn.Module) -> Rule:
    """The registered rule of a leaf module, or the error that says what to do."""
    rule = RULES.get(type(module))
    if rule is None:
        raise unsupported(module, "")
    return rule


def unsupported(module: nn.Module, path: str) -> NotImplementedError:
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


def as_output(tmp: Tensor, shape: torch.Size, where: str) -> tuple[Tensor, bool]:
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
        m, flat = as_output(tmp, val.shape, type(module).__name__)
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
        m, _ = as_output(tmp, val.shape, type(module).__name__)
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


# Upstream fix: integration/checks/upstream/stochman/0002-conv2d-sandwich-stride.patch
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


# Upstream fix: integration/checks/upstream/stochman/0001-upsample-sandwich-per-channel.patch
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


# -- registration ---------------------------------------------------------------------------------

SAME_FORWARD: tuple[type[nn.Module], ...] = (
    # StochMan's classes whose forward computes what their torch.nn parent's does (MaxPool*d
    # also stores the pooling indices; Identity, Flatten and Reshape have no torch.nn parent:
    # see _PARENTLESS).
    nnj.Identity, nnj.Linear, nnj.Conv1d, nnj.Conv2d, nnj.Conv3d, nnj.ConvTranspose1d,
    nnj.ConvTranspose2d, nnj.ConvTranspose3d, nnj.Upsample, nnj.MaxPool1d, nnj.MaxPool2d,
    nnj.MaxPool3d, nnj.Flatten, nnj.Reshape, nnj.Tanh, nnj.Sigmoid, nnj.ReLU, nnj.LeakyReLU,
    nnj.ELU, nnj.Softplus, nnj.Softmax, nnj.BatchNorm1d, nnj.BatchNorm2d, nnj.BatchNorm3d,
    # This package's leaf classes (and MeanHead): StochMan's with the sandwiches by the rules.
    Identity, Linear, Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d,
    Upsample, MaxPool1d, MaxPool2d, MaxPool3d, Flatten, Reshape, Tanh, Sigmoid, ReLU, LeakyReLU,
    ELU, Softplus, BatchNorm1d, BatchNorm2d, BatchNorm3d, MeanHead,
)  # fmt: skip
"""The classes :func:`register` registers, each with its ``torch.nn`` parent's rule
(:func:`torch_parent`). ``nnj`` classes with another ``forward`` (``ArcTanh`` subclasses
``nn.Tanh``, ``PosLinear`` ``nn.Linear``) are not listed."""

_PARENTLESS: dict[type[nn.Module], type[nn.Module]] = {
    nnj.Identity: nn.Identity,
    nnj.Flatten: nn.Flatten,  # [B, *] → [B, prod(*)], as nn.Flatten()
    nnj.Reshape: nn.Unflatten,  # [B, *] → [B, *dims]: a view of each sample, as nn.Unflatten
}
"""StochMan's classes that extend ``nn.Module`` directly, and the ``torch.nn`` class each
computes like (all three move entries without changing them: ``StructuralRule``)."""


def torch_parent(cls: type[nn.Module]) -> type[nn.Module]:
    """The ``torch.nn`` class whose registered rule describes ``cls``.

    The nearest class in ``cls.__mro__`` that is a ``torch.nn`` class with a rule
    (``nnj.Conv2d`` → ``nn.Conv2d``, :class:`MeanHead` → ``nn.Conv2d``), or for a class extending
    one of ``nnj.Identity``, ``nnj.Flatten``, ``nnj.Reshape`` its counterpart in
    :data:`_PARENTLESS`.

    Raises:
        LookupError: If there is none, naming the class.
    """
    for c in cls.__mro__:
        if c in _PARENTLESS:
            return _PARENTLESS[c]
        if c.__module__.startswith("torch.nn.") and c in RULES:
            return c
    raise LookupError(f"{cls.__qualname__} has no torch.nn parent with a rule")


def register(*, override: bool = False) -> list[type[nn.Module]]:
    """Register StochMan's ``nnj`` layers and this package's leaf classes in the rule table.

    Each class of :data:`SAME_FORWARD` gets the rule registered for its ``torch.nn`` parent
    (:func:`torch_parent`: ``nnj.Conv2d`` → ``RULES[nn.Conv2d]``, a ``ConvRule``; ``nnj.Tanh`` →
    a ``TanhRule``; ``nnj.MaxPool2d`` / ``nnj.Flatten`` / ``nnj.Reshape`` → a
    ``StructuralRule``, …), through :func:`lsn_ext.register_rule`. Run on import of
    :mod:`lsn_ext.stochman_ext`; idempotent.
    Afterwards the native engine (:func:`lsn_ext.diag_backprop`), laplace-torch's
    ``DiagBackprop`` backend and the BackPACK adapter accept ``nnj`` networks.

    Args:
        override: Replace rules already registered for these classes (by default a class that
            has a rule keeps it, e.g. one the user registered).

    Returns:
        The classes newly registered (or replaced) by this call.
    """
    done = []
    for cls in SAME_FORWARD:
        if cls in RULES and not override:
            continue
        register_rule(cls, RULES[torch_parent(cls)], override=override)
        done.append(cls)
    return done
