"""The rule table: one diagonal-backprop rule per supported module type.

Every adapter (the native engine, the BackPACK extension, the StochMan ``nnj`` modules) looks rules
up here, so the mathematics of each layer lives in exactly one place. Lookup is by exact class, as
in BackPACK: a subclass with its own ``forward`` may compute something else, so it must be
registered explicitly::

    import lsn_ext
    lsn_ext.register_rule(MyConv2d, lsn_ext.rules.ConvRule())

Adding a layer is three touches: a :class:`~lsn_ext.rules.base.Rule` subclass in this package, one
line in :data:`RULES`, and one case in ``tests/rules``. Besides its maths, a rule carries, as
class attributes, every fact about its module type that the adapters need (no adapter keeps a
table of module classes of its own):

- ``autograd_exact``, ``needs_input``, ``needs_output``: what the engines may skip or keep;
- ``functional``: the torch functions that compute what the module computes
  (:class:`~lsn_ext.rules.base.Functional`: name, module class, arguments), which the native
  engine then runs in ``forward`` as nodes of the rule (``F.tanh(x)`` as ``nn.Tanh``; the table
  is :func:`functional_forms`, read at each pass);
- ``per_sample_kernel``: the Monte-Carlo estimator's direct per-sample-gradient kernel
  (``"convolution"``, ``"linear"``, ``"norm"`` or ``None``), used for modules of the
  ``torch.nn`` class itself only.

The StochMan adapter lists only the ``nnj`` classes whose ``forward`` computes what their
``torch.nn`` parent's does; each takes the rule registered for that parent.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable

from torch import nn
from torch.nn.utils import parametrize

from lsn_ext.rules.base import Functional, Rule
from lsn_ext.rules.conv import ConvRule
from lsn_ext.rules.elementwise import (
    CELURule,
    ElementwiseRule,
    ELURule,
    GELURule,
    HardsigmoidRule,
    HardswishRule,
    LeakyReLURule,
    MishRule,
    PReLURule,
    ReLURule,
    SELURule,
    SigmoidRule,
    SiLURule,
    SoftplusRule,
    TanhRule,
)
from lsn_ext.rules.linear import LinearRule
from lsn_ext.rules.norm import BatchNormRule, GroupNormRule, InstanceNormRule, LayerNormRule
from lsn_ext.rules.pooling import AvgPoolRule
from lsn_ext.rules.softmax import LogSoftmaxRule, SoftmaxRule
from lsn_ext.rules.structural import DropoutRule, StructuralRule
from lsn_ext.rules.upsample import UpsampleRule

__all__ = [
    "RULES",
    "AvgPoolRule",
    "BatchNormRule",
    "CELURule",
    "ConvRule",
    "DropoutRule",
    "ELURule",
    "ElementwiseRule",
    "Functional",
    "GELURule",
    "GroupNormRule",
    "HardsigmoidRule",
    "HardswishRule",
    "InstanceNormRule",
    "LayerNormRule",
    "LeakyReLURule",
    "LinearRule",
    "LogSoftmaxRule",
    "MishRule",
    "PReLURule",
    "ReLURule",
    "Rule",
    "SELURule",
    "SiLURule",
    "SigmoidRule",
    "SoftmaxRule",
    "SoftplusRule",
    "StructuralRule",
    "TanhRule",
    "UpsampleRule",
    "functional_forms",
    "get_rule",
    "register_adapters_for",
    "register_rule",
    "supported_modules",
]

RULES: dict[type[nn.Module], Rule] = {
    nn.Linear: LinearRule(),
    nn.Conv1d: ConvRule(),
    nn.Conv2d: ConvRule(),
    nn.Conv3d: ConvRule(),
    nn.ConvTranspose1d: ConvRule(),
    nn.ConvTranspose2d: ConvRule(),
    nn.ConvTranspose3d: ConvRule(),
    nn.Tanh: TanhRule(),
    nn.Sigmoid: SigmoidRule(),
    nn.ReLU: ReLURule(),
    nn.LeakyReLU: LeakyReLURule(),
    nn.ELU: ELURule(),
    nn.SiLU: SiLURule(),
    nn.GELU: GELURule(),
    nn.Softplus: SoftplusRule(),
    nn.Mish: MishRule(),
    nn.Hardswish: HardswishRule(),
    nn.Hardsigmoid: HardsigmoidRule(),
    nn.SELU: SELURule(),
    nn.CELU: CELURule(),
    nn.Softmax: SoftmaxRule(),
    nn.Softmax2d: SoftmaxRule(),
    nn.LogSoftmax: LogSoftmaxRule(),
    nn.ReLU6: StructuralRule(),
    nn.Hardtanh: StructuralRule(),
    nn.Identity: StructuralRule(),
    nn.Flatten: StructuralRule(),
    nn.Unflatten: StructuralRule(),
    nn.MaxPool1d: StructuralRule(),
    nn.MaxPool2d: StructuralRule(),
    nn.MaxPool3d: StructuralRule(),
    nn.Dropout: DropoutRule(),
    nn.Dropout1d: DropoutRule(),
    nn.Dropout2d: DropoutRule(),
    nn.Dropout3d: DropoutRule(),
    nn.AvgPool1d: AvgPoolRule(),
    nn.AvgPool2d: AvgPoolRule(),
    nn.AvgPool3d: AvgPoolRule(),
    nn.Upsample: UpsampleRule(),
    nn.UpsamplingNearest2d: UpsampleRule(),
    nn.UpsamplingBilinear2d: UpsampleRule(),
    nn.BatchNorm1d: BatchNormRule(),
    nn.BatchNorm2d: BatchNormRule(),
    nn.BatchNorm3d: BatchNormRule(),
    nn.InstanceNorm1d: InstanceNormRule(),
    nn.InstanceNorm2d: InstanceNormRule(),
    nn.InstanceNorm3d: InstanceNormRule(),
    nn.GroupNorm: GroupNormRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.PReLU: PReLURule(),
}


def register_rule(module_cls: type[nn.Module], rule: Rule, *, override: bool = False) -> None:
    """Register ``rule`` for modules of exactly the class ``module_cls``.

    Args:
        module_cls: The module class (exact match; subclasses are not covered).
        rule: The rule instance.
        override: Replace an existing registration instead of raising.

    Raises:
        TypeError: If ``module_cls`` is not an ``nn.Module`` subclass or ``rule`` not a ``Rule``.
        ValueError: If ``module_cls`` is registered already and ``override`` is false.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"register_rule expects an nn.Module subclass, got {module_cls!r}")
    if not isinstance(rule, Rule):
        raise TypeError(f"register_rule expects a lsn_ext.rules.Rule instance, got {rule!r}")
    if module_cls in RULES and not override:
        raise ValueError(
            f"{module_cls.__qualname__} already has the rule {type(RULES[module_cls]).__name__}; "
            "pass override=True to replace it"
        )
    RULES[module_cls] = rule


# Libraries whose module classes get their rules when an lsn_ext adapter is imported.
_ADAPTERS = {"stochman": "lsn_ext.stochman_ext"}


def register_adapters_for(model: nn.Module | Iterable[nn.Module]) -> None:
    """Import the adapters that register rules for library modules found in ``model``.

    ``import lsn_ext`` is lazy, and StochMan's ``nnj`` layers get their rules when
    :mod:`lsn_ext.stochman_ext` is imported; the engines call this before looking rules up, so a
    model of ``nnj`` layers works whichever way lsn_ext was imported. ``model`` may also be the
    model's modules, already listed. Each module class is looked at once per process.

    Args:
        model: The model, or its modules.
    """
    modules = model.modules() if isinstance(model, nn.Module) else model
    for cls in {type(m) for m in modules} - _LOOKED_AT:
        adapter = _ADAPTERS.get(cls.__module__.split(".")[0])
        if adapter is not None and adapter not in sys.modules:
            importlib.import_module(adapter)
        _LOOKED_AT.add(cls)


_LOOKED_AT: set[type] = set()
"""Module classes already looked at: an adapter, once imported, stays registered (no result
depends on when it was imported)."""


def functional_forms() -> dict[str, tuple[Functional, Rule]]:
    """The functional forms of the registered rules: function name → ``(form, rule)``.

    A rule's form (:attr:`Rule.functional <lsn_ext.rules.base.Rule>`) counts where its module
    class is registered with that rule, so that the function runs as a node of the rule the
    module itself would get: ``F.tanh`` as ``nn.Tanh`` with ``RULES[nn.Tanh]``. Read from
    :data:`RULES` at each call, so a rule registered later is seen.

    Returns:
        ``{name: (form, rule)}``, e.g. ``"tanh"`` → the ``F.tanh`` form and ``RULES[nn.Tanh]``.

    Raises:
        ValueError: If the rules of two registered module classes claim one function name,
            naming both.
    """
    forms: dict[str, tuple[Functional, Rule]] = {}
    for cls, rule in RULES.items():
        for form in rule.functional:
            if form.module is not cls:
                continue
            if form.name in forms:
                other = forms[form.name][0].module
                raise ValueError(
                    f"the functional form '{form.name}' is claimed by the rules of {_name(other)} "
                    f"and {_name(cls)}; a function can run as one module only: give one of the "
                    "rules another functional form (Rule.functional)"
                )
            forms[form.name] = (form, rule)
    return forms


def supported_modules() -> list[str]:
    """The module classes that diagonal backpropagation has a rule for, by full name, sorted.

    Read from :data:`RULES` at each call, so classes registered with :func:`register_rule` (and
    StochMan's ``nnj`` layers, registered when :mod:`lsn_ext.stochman_ext` is imported, which
    ``lsn_ext``'s public names do) are listed too. A rule covers its exact class, not
    subclasses. Each rule is exact for its layer given a diagonal curvature at its output; the
    approximation of diagonal backpropagation is that the diagonal is taken again after every
    layer (:mod:`lsn_ext.rules.base`). Modules without a rule need the Monte-Carlo estimator
    (``estimator="mc"``), which needs no rules.

    Returns:
        Fully qualified class names, e.g. ``"torch.nn.modules.conv.Conv2d"``, sorted.

    Example:
        >>> import lsn_ext
        >>> "torch.nn.modules.conv.Conv2d" in lsn_ext.supported_modules()
        True
    """
    return sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in RULES)


def _name(cls: type) -> str:
    """``torch.nn.Conv2d``-style name, unambiguous for subclasses of the same name."""
    module = cls.__module__.replace("torch.nn.modules.", "torch.nn.").split(".")
    if module[:2] == ["torch", "nn"]:
        module = ["torch", "nn"]
    return f"{'.'.join(module)}.{cls.__qualname__}"


def get_rule(module: nn.Module, path: str = "") -> Rule:
    """Return the rule registered for ``type(module)``.

    Args:
        module: The module to look up.
        path: Its dotted path in the model, used in the error message.

    Returns:
        The :class:`~lsn_ext.rules.base.Rule` registered for the module's exact class.

    Raises:
        NotImplementedError: If there is no rule for the module's exact class; the message names
            the module and lists what is supported.
    """
    try:
        return RULES[type(module)]
    except KeyError:
        cls = type(module)
        where = f" at '{path}'" if path else ""
        parent = next((c for c in cls.__mro__[1:] if c in RULES), None)
        if parametrize.is_parametrized(module):
            hint = (
                " Its tensors are parametrized (torch.nn.utils.parametrize, e.g. weight_norm): "
                "a rule for the class would give the parametrization's parameters zero "
                "curvature, so do not register one; remove the parametrization for the "
                "curvature (torch.nn.utils.parametrize.remove_parametrizations)."
            )
        elif parent is not None and cls.forward is parent.forward:
            hint = (
                f" It subclasses {_name(parent)} without changing forward: register it with "
                f"lsn_ext.register_rule({cls.__qualname__}, "
                f"lsn_ext.rules.{type(RULES[parent]).__name__}())."
            )
        elif parent is not None:
            hint = (
                f" It subclasses {_name(parent)} but overrides forward, so that rule does not "
                "apply: write a lsn_ext.rules.Rule for it and call lsn_ext.register_rule."
            )
        else:
            hint = " Write a lsn_ext.rules.Rule for it and call lsn_ext.register_rule."
        raise NotImplementedError(
            f"Diagonal backprop has no rule for {_name(cls)}{where}.{hint} Or use the "
            "Monte-Carlo estimator (estimator='mc' in lsn_ext.ggn_diagonal and DiagBackprop, "
            "their default), which needs no rules. "
            f"Supported modules: {', '.join(_name(c) for c in RULES)}."
        ) from None
