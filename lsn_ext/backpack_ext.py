r"""BackPACK adapter: diagonal backpropagation as a BackPACK extension.

::

    from backpack import backpack, extend
    from lsn_ext.backpack_ext import DiagBackpropExtension, convert, diagonals

    net = convert(unet, x)                      # a converted, extended copy; unet is untouched
    lossfunc = extend(nn.CrossEntropyLoss())    # logits [N, C, H, W], targets [N, H, W]
    with backpack(DiagBackpropExtension()):
        lossfunc(net(x), y).backward()
    diag = diagonals(net)                       # {name: p.diag_backprop}, same names as unet

The adapter only translates: every layer's maths comes from the rule table
:data:`lsn_ext.rules.RULES` (looked up by exact class when the backward pass reaches the module,
so a rule registered with :func:`lsn_ext.register_rule` at any time reaches BackPACK too), every
loss Hessian from :func:`lsn_ext.rules.losses.as_loss`. The results equal
:func:`lsn_ext.diag_backprop` on the same network.

How BackPACK runs it. BackPACK calls each extended module's backward hook; the module extension
takes the quantity ``m`` backpropagated to the module's output (BackPACK keys these by the
output's ``data_ptr()``), applies the rule, saves the parameter diagonals as
``param.diag_backprop`` and saves ``m_in`` for the module's input, summing over the uses of a
tensor. Shapes: ``m`` is always shaped like the tensor it belongs to (``[N, *]``), parameter
diagonals like their parameter.

What BackPACK forced on this adapter (BackPACK 1.7.1):

- **Concatenation.** BackPACK's ``ModuleExtension.__call__`` hands the *same* backpropagated
  quantity to every input of a module, and its converter leaves ``torch.cat`` as a function (with
  two or more ``torch.cat`` calls its duplicate-removal step even fails). The module extensions
  here therefore override ``__call__`` and save a separate quantity per input:
  :class:`Cat` (``torch.cat`` as a module) splits ``m`` along ``dim``, BackPACK's ``SumModule``
  gives every input ``m``. :func:`convert` traces the model with ``torch.fx`` and turns every
  ``torch.cat`` call into a :class:`Cat` module before BackPACK's own converter runs.
  :class:`Cat` subclasses BackPACK's ``SumModule`` (a branch merge, as BackPACK calls it) only
  because BackPACK's tracer keeps ``isinstance(m, SumModule)`` modules as single nodes; lookups
  of module extensions are by exact class, so no BackPACK extension mistakes it for a sum.
- **Losses.** BackPACK's own loss derivatives take 2-D inputs only; the loss extensions here
  take ``nn.BCEWithLogitsLoss``, ``nn.CrossEntropyLoss`` and ``nn.MSELoss`` on ``[N, C, *]``
  logits with their options. For cross-entropy the exact first step of the native engine is
  reproduced: the loss passes the per-position Hessian block to the head (the logits must be
  the direct output of a ``Linear`` or convolution module), see :class:`DiagBackpropExtension`.
- **Re-entrancy.** Some rules evaluate the module (a VJP of a 0/1-Jacobian layer); the adapter
  hands them a shallow copy of the module without hooks, so BackPACK's hooks do not run again.
- **Upsampling, custom modules.** BackPACK has no ``nn.Upsample`` rule and no module
  extension for lsn_ext's rules; the mapping is built from the rule table plus ``SumModule``,
  ``ScaleModule`` (``c² m``), ``Permute`` and :class:`Cat`.
- **Tracing.** ``extend(model, use_converter=True)`` traces with plain ``torch.fx`` (no shape
  checks in ``forward``), adds modules to the model it is given and installs hooks on the
  model's own modules, which then no longer work with ``torch.func``. :func:`convert` works on a
  deep copy and traces with the shapes of an example input.

Limitations (BackPACK's design): a module with parameters may be called only once per forward
pass (BackPACK stores one input per module; the native engine has no such limit); operations in
``forward`` must be modules or the functions :func:`convert` turns into modules (``torch.cat``,
``+``, ``-``, multiplication and division by a number, negation, ``flatten``, ``permute``,
``transpose``); quantities are keyed by ``data_ptr()``, so a reshaping *view* of a tensor that
is also used elsewhere confuses them (an error is raised when shapes disagree).
"""

from __future__ import annotations

import copy
import inspect
import numbers
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from backpack import extend
from backpack.custom_module.branching import SumModule
from backpack.custom_module.graph_utils import BackpackTracer
from backpack.custom_module.permute import Permute
from backpack.custom_module.scale_module import ScaleModule
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.proxy import TraceError

from lsn_ext.rules import RULES, Rule, StructuralRule, get_rule
from lsn_ext.rules.elementwise import scale_rule
from lsn_ext.rules.losses import as_loss

try:  # shape-aware tracing; torch.fx.experimental is not a stable API
    from torch.fx.experimental.meta_tracer import MetaTracer
except ImportError:  # pragma: no cover - depends on the torch version
    MetaTracer = None

__all__ = ["SAVEFIELD", "Cat", "DiagBackpropExtension", "convert", "diagonals"]

SAVEFIELD = "diag_backprop"
"""The attribute every parameter's diagonal is saved in."""


# Upstream fix: integration/checks/upstream/backpack/0001-cat-module-and-torch-cat-converter.patch
class Cat(SumModule):
    """``torch.cat(inputs, dim)`` as a module, so that BackPACK sees concatenations.

    Its DB step is exact and structural: the Jacobian of a concatenation selects entries, so the
    ``m`` of input ``i`` is the slice of the output's ``m`` that input ``i`` fills.
    :func:`convert` inserts these modules for ``torch.cat`` calls; models built for
    ``backpack.extend(model, use_converter=True)`` may also use them directly.

    Subclassing BackPACK's ``SumModule`` (a branch merge) only keeps BackPACK's tracer from
    tracing into it; BackPACK looks module extensions up by exact class.

    Args:
        dim: The dimension to concatenate along, as in ``torch.cat``.

    Example:
        >>> Cat(dim=1)(torch.zeros(2, 3, 4), torch.ones(2, 5, 4)).shape
        torch.Size([2, 8, 4])
    """

    def __init__(self, dim: int = 0):
        super().__init__()
        self.dim = dim

    def forward(self, *inputs: Tensor) -> Tensor:
        """Concatenate ``inputs`` (``[N, C_i, *]`` for ``dim=1``) along :attr:`dim`.

        Args:
            *inputs: The tensors, equal in every dimension but :attr:`dim`.

        Returns:
            ``[N, Σ C_i, *]`` for ``dim=1``.
        """
        return torch.cat(inputs, dim=self.dim)

    def extra_repr(self) -> str:
        """``dim=...`` in ``repr``.

        Returns:
            ``"dim=…"``.
        """
        return f"dim={self.dim}"


@dataclass(frozen=True)
class _FirstStep:
    """What the cross-entropy loss hands to the head for the exact first step.

    Attributes:
        diag: ``diag(H)``, ``[N, C, *]``; used for the head's parameters.
        block: The per-position Hessian block ``[N, C, C, *]``; used for the head's input.
    """

    diag: Tensor
    block: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.diag.shape


def _first_step_error(module: nn.Module) -> ValueError:
    return ValueError(
        "the exact cross-entropy first step needs the logits to be the direct output of a "
        f"Linear or convolution module, but they come from {_describe(module)}. Make the head "
        "the last operation of forward, or pass ce_first_step='diag' to DiagBackpropExtension "
        "(starts from diag(H), which overestimates the curvature)"
    )


def _describe(module: nn.Module) -> str:
    """``Class(settings)``, without the children of containers."""
    return f"{type(module).__name__}({module.extra_repr()})"


def _inputs(module: nn.Module) -> list[Tensor]:
    """The tensors BackPACK stored as ``module.input0``, ``module.input1``, and so on."""
    found, i = [], 0
    while hasattr(module, f"input{i}"):
        found.append(getattr(module, f"input{i}"))
        i += 1
    return found


def _without_hooks(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (same parameters and settings) with no hooks.

    Rules may evaluate the module (a VJP through a 0/1-Jacobian layer); calling the extended
    module itself inside its own backward hook would run BackPACK's hooks again.
    """
    twin = copy.copy(module)
    for name, value in vars(module).items():
        if "hooks" in name and isinstance(value, dict):
            twin.__dict__[name] = type(value)()
    return twin


class _ScaleModuleRule(Rule):
    """BackPACK's ``ScaleModule`` (``y = c · x``): :func:`~lsn_ext.rules.elementwise.scale_rule`."""

    def input_rule(self, module: ScaleModule, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """``m_in = c² · m_out``, shaped like ``x``."""
        return scale_rule(m_out, module.weight, x.shape)


class _RuleExtension(ModuleExtension):
    """Runs a rule of :data:`lsn_ext.rules.RULES` (looked up per call) or a fixed rule.

    Args:
        rule: A fixed rule; ``None`` looks ``type(module)`` up in the rule table at each call.
    """

    def __init__(self, rule: Rule | None = None):
        super().__init__()
        self.rule = rule

    def __call__(
        self,
        extension: DiagBackpropExtension,
        module: nn.Module,
        g_inp: tuple[Tensor | None, ...],
        g_out: tuple[Tensor | None, ...],
    ) -> None:
        rule = self.rule if self.rule is not None else get_rule(module)
        rule.check(module)  # e.g. dropout or batch norm in training mode: ValueError
        m = extension.take(module)
        x, y = module.input0, module.output
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        need_input = x.requires_grad
        twin, xd, yd = _without_hooks(module), x.detach(), y.detach()
        with torch.no_grad():
            if isinstance(m, _FirstStep):
                if not rule.has_block_rule():
                    raise _first_step_error(module)
                m_in = rule.input_rule_block(twin, xd, yd, m.block) if need_input else None
                _, diags = rule.backward(twin, xd, yd, m.diag, False, bool(params))
            else:
                m_in, diags = rule.backward(twin, xd, yd, m, need_input, bool(params))
        for name, p in params.items():
            setattr(p, extension.savefield, diags[name])
        if m_in is not None:
            extension.give(x, m_in)


class _SumExtension(ModuleExtension):
    """BackPACK's ``SumModule`` (``y = Σ x_i``): every input gets ``m`` (0/1 Jacobian)."""

    def __call__(self, extension, module, g_inp, g_out) -> None:
        m = extension.take(module)
        if isinstance(m, _FirstStep):
            raise _first_step_error(module)
        for x in _inputs(module):
            if x.requires_grad:
                extension.give(x, m)


# Upstream fix: integration/checks/upstream/backpack/0001-cat-module-and-torch-cat-converter.patch
class _CatExtension(ModuleExtension):
    """:class:`Cat`: input ``i`` gets its slice of ``m`` along ``dim`` (0/1 Jacobian)."""

    def __call__(self, extension, module: Cat, g_inp, g_out) -> None:
        m = extension.take(module)
        if isinstance(m, _FirstStep):
            raise _first_step_error(module)
        inputs = _inputs(module)
        pieces = m.split([x.shape[module.dim] for x in inputs], dim=module.dim)
        for x, piece in zip(inputs, pieces, strict=True):
            if x.requires_grad:
                extension.give(x, piece)


# Upstream fix: integration/checks/upstream/backpack/0004-dense-mse-bce-sqrt-hessian.patch
class _LossExtension(ModuleExtension):
    """Starts the recursion: ``m = diag(H)`` of the loss at the logits (``module.input0``).

    For cross-entropy with ``ce_first_step="exact"`` the head receives ``diag(H)`` and the
    per-position block ``[N, C, C, *]`` instead (see :class:`DiagBackpropExtension`).
    """

    def __call__(self, extension, module: nn.Module, g_inp, g_out) -> None:
        g = g_out[0]
        if g is None or g.numel() != 1 or g.item() != 1.0:
            raise ValueError(
                f"{type(module).__name__}: diagonal backprop needs backward() on the loss "
                "itself (or on a sum of losses); its output was scaled or transformed before "
                "backward (output gradient "
                f"{None if g is None else g.detach().reshape(-1)[:3].tolist()}). Set the "
                "loss's reduction instead of scaling it"
            )
        logits, targets = module.input0, module.input1
        if not logits.requires_grad:
            return
        loss = as_loss(module)
        f = logits.detach()
        with torch.no_grad():
            diag = loss.hessian_diag(f, targets)
            block = loss.hessian_block(f, targets) if extension.ce_first_step == "exact" else None
        extension.give(logits, diag if block is None else _FirstStep(diag, block))


_LOSSES = (nn.BCEWithLogitsLoss, nn.CrossEntropyLoss, nn.MSELoss)
_EXTRA_CLASSES = (SumModule, Cat, ScaleModule, Permute, *_LOSSES)


def _extra_extensions() -> dict[type[nn.Module], ModuleExtension]:
    """Module extensions for the classes that have no entry in the rule table."""
    return {
        SumModule: _SumExtension(),
        Cat: _CatExtension(),
        ScaleModule: _RuleExtension(_ScaleModuleRule()),
        Permute: _RuleExtension(StructuralRule()),
        **{cls: _LossExtension() for cls in _LOSSES},
    }


class DiagBackpropExtension(BackpropExtension):
    """Diagonal backpropagation of the GGN (LSN paper Eq. 22) as a BackPACK extension.

    Inside ``with backpack(DiagBackpropExtension()): loss.backward()`` on an extended model and
    loss, every parameter that requires grad gets ``p.diag_backprop`` (shaped like ``p``): the
    DB diagonal ``Σ_n D(J_nᵀ H_n J_n)`` of the batch, equal to :func:`lsn_ext.diag_backprop`.

    Supported modules: every class in :data:`lsn_ext.rules.RULES` (looked up by exact class
    when the backward pass reaches the module, so later :func:`lsn_ext.register_rule` calls
    count), BackPACK's ``SumModule``, ``ScaleModule`` and ``Permute`` (what
    ``extend(..., use_converter=True)`` creates), :class:`Cat`, and the losses
    ``nn.BCEWithLogitsLoss``, ``nn.CrossEntropyLoss`` and ``nn.MSELoss`` on logits
    ``[N, C, *]`` with all their options (``nn.MSELoss`` is ``Σ (f − y)²``, Hessian 2;
    ``reduction="mean"`` divides as torch does). ``backward()`` must be called on the loss
    module's output (or a sum of them), not on a multiple of it.

    Args:
        ce_first_step: ``"exact"`` (default) propagates the per-position ``C×C`` Hessian block
            of the cross-entropy through the head, like the native engine; the logits must then
            be the direct output of a ``Linear`` or convolution module. ``"diag"`` starts
            from ``diag(H)``.

    Raises:
        ValueError: For an unknown ``ce_first_step``.

    In the backward pass, ``NotImplementedError`` names a module without a rule, or a module
    that received no quantity (an operation in ``forward`` that BackPACK cannot see: use
    :func:`convert`); ``ValueError`` reports a module in a mode without a rule (training-mode
    dropout or batch norm) or a cross-entropy head that is not linear.
    """

    def __init__(self, ce_first_step: Literal["exact", "diag"] = "exact"):
        if ce_first_step not in ("exact", "diag"):
            raise ValueError(f"ce_first_step must be 'exact' or 'diag', got {ce_first_step!r}")
        self.ce_first_step = ce_first_step
        # Upstream fix (nn.Upsample):
        # integration/checks/upstream/backpack/0003-upsample-derivatives.patch
        mapping: dict[type[nn.Module], ModuleExtension] = {cls: _RuleExtension() for cls in RULES}
        mapping.update(_extra_extensions())
        self._classes = set(mapping)
        super().__init__(savefield=SAVEFIELD, module_exts=mapping)

    def expects_backpropagation_quantities(self) -> bool:
        """DB backpropagates ``m`` (second-order extensions do).

        Returns:
            ``True``.
        """
        return True

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        """Add or replace the module extension of a class (BackPACK's extension point).

        Args:
            module: The module class (exact match).
            extension: BackPACK's ``ModuleExtension`` for it.
            overwrite: Replace an existing extension instead of raising (BackPACK's check).
        """
        super().set_module_extension(module, extension, overwrite)
        self._classes.add(module)

    def __call__(
        self,
        module: nn.Module,
        g_inp: tuple[Tensor | None, ...],
        g_out: tuple[Tensor | None, ...],
    ) -> None:
        """Run the module extension of ``module`` (BackPACK calls this in its backward hook).

        Args:
            module: The module whose backward hook fired.
            g_inp: Gradients w.r.t. the module's inputs (BackPACK's hook argument).
            g_out: Gradients w.r.t. the module's outputs.

        Raises:
            NotImplementedError: If ``type(module)`` has neither a rule nor an extension.
        """
        cls = type(module)
        if cls not in self._classes:
            if cls not in RULES:
                raise self._unsupported(module)
            self.set_module_extension(cls, _RuleExtension())  # registered after __init__
        super().__call__(module, g_inp, g_out)

    @staticmethod
    def _unsupported(module: nn.Module) -> NotImplementedError:
        try:
            get_rule(module)
            detail = ""
        except NotImplementedError as err:
            detail = f" {err}"
        return NotImplementedError(
            f"DiagBackpropExtension cannot handle {_describe(module)}.{detail} For BackPACK "
            "only, DiagBackpropExtension().set_module_extension(cls, extension) adds a module "
            "extension. If the module is a container whose forward calls functions "
            "(torch.cat, +, ...), convert the model with "
            "lsn_ext.backpack_ext.convert(model, example_input) before the forward pass."
        )

    def accumulate_backpropagated_quantities(self, existing: Any, other: Any) -> Any:
        """Sum the ``m`` of a tensor used more than once (fan-out; LSN paper Eq. 27).

        Args:
            existing: The ``m`` saved so far (a tensor, or the cross-entropy's first step).
            other: The ``m`` of another use, of the same kind and shape.

        Returns:
            ``existing + other``.

        Raises:
            ValueError: If the exact cross-entropy first step meets another quantity (the
                logits are used elsewhere).
            NotImplementedError: For quantities of different shapes on one storage (a reshaping
                view of a tensor used elsewhere).
        """
        if isinstance(existing, _FirstStep) and isinstance(other, _FirstStep):
            return _FirstStep(existing.diag + other.diag, existing.block + other.block)
        if isinstance(existing, _FirstStep) or isinstance(other, _FirstStep):
            raise ValueError(
                "the logits of a cross-entropy loss with ce_first_step='exact' are also used "
                "elsewhere in the graph; the exact first step needs the head's output to feed "
                "the loss only (or pass ce_first_step='diag')"
            )
        if existing.shape != other.shape:
            raise NotImplementedError(
                f"two quantities of shapes {tuple(existing.shape)} and {tuple(other.shape)} "
                "reached tensors sharing one data_ptr: BackPACK identifies tensors by their "
                "storage, so a reshaping view of a tensor that is also used elsewhere cannot "
                "be told apart from it. Use nn.Flatten/nn.Unflatten on a tensor used once"
            )
        return existing + other

    # -- BackPACK's storage of backpropagated quantities, keyed by data_ptr -----------------

    def take(self, module: nn.Module) -> Tensor | _FirstStep:
        """Remove and return the ``m`` saved for ``module.output``.

        Args:
            module: The module whose output's ``m`` is asked for.

        Returns:
            ``m``, shaped like ``module.output`` (or the cross-entropy's first step).

        Raises:
            NotImplementedError: If none arrived, or one of another shape: an operation
                between the module and the loss is invisible to BackPACK.
        """
        out = module.output
        m = self.saved_quantities.retrieve_quantity(out.data_ptr(), delete_old=True)
        if m is None or m.shape != out.shape:
            got = "nothing" if m is None else f"a quantity of shape {tuple(m.shape)}"
            raise NotImplementedError(
                f"the output of {_describe(module)}, shape {tuple(out.shape)}, received {got} "
                "from the modules after it. Every operation between it and the loss must be a "
                "module BackPACK hooks: a function in forward (torch.cat, x.view, torch.tanh, "
                "...) breaks the chain. Use lsn_ext.backpack_ext.convert(model, example_input), "
                "modules instead of functions, and call extend() on the loss function too"
            )
        return m

    def give(self, tensor: Tensor, m: Tensor | _FirstStep) -> None:
        """Save ``m`` for ``tensor`` (summed with what other uses of it saved).

        Args:
            tensor: A module input (identified by its storage, as BackPACK does).
            m: Its DB diagonal, shaped like ``tensor`` (or the cross-entropy's first step).
        """
        self.saved_quantities.save_quantity(
            tensor.data_ptr(), m, self.accumulate_backpropagated_quantities
        )


def diagonals(model: nn.Module) -> dict[str, Tensor]:
    """``{name: p.diag_backprop}`` for every parameter of ``model`` that requires grad.

    Args:
        model: A model after ``backward()`` inside ``backpack(DiagBackpropExtension())``.

    Returns:
        Parameter name → diagonal (shaped like the parameter), in ``named_parameters`` order.

    Raises:
        ValueError: If a parameter has no diagonal (no backward pass with the extension, or the
            parameter does not influence the loss).
    """
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not hasattr(p, SAVEFIELD):
            raise ValueError(
                f"parameter '{name}' has no {SAVEFIELD}: run loss.backward() inside "
                "backpack(DiagBackpropExtension()) on the extended model and loss first"
            )
        out[name] = getattr(p, SAVEFIELD)
    return out


# -- conversion ---------------------------------------------------------------------------------

_BACKPACK_LEAVES = (SumModule, ScaleModule, Permute)


def _has_extension(m: nn.Module) -> bool:
    """Whether the adapter handles ``m`` as one layer (a rule, or a module extension here)."""
    return type(m) in RULES or isinstance(m, _BACKPACK_LEAVES)


class _Tracer(BackpackTracer):
    """BackPACK's tracer, also keeping every module with a rule as one node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _has_extension(m) or super().is_leaf_module(m, module_qualified_name)


if MetaTracer is not None:

    class _ShapeTracer(MetaTracer):
        """Evaluates every node while tracing, so shape checks in ``forward`` (``x.dim()``) run."""

        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            return _has_extension(m) or super().is_leaf_module(m, module_qualified_name)


_CAT = (torch.cat, torch.concat, torch.concatenate)
_ADD = (operator.add, torch.add, "add")
_SUB = (operator.sub, torch.sub, torch.subtract, "sub", "subtract")
_MUL = (operator.mul, torch.mul, torch.multiply, "mul", "multiply")
_DIV = (operator.truediv, torch.div, torch.divide, torch.true_divide, "div", "divide",
        "true_divide")  # fmt: skip
_NEG = (operator.neg, torch.neg, torch.negative, "neg", "negative")
_FLATTEN = (torch.flatten, "flatten")
_PERMUTE = (torch.permute, "permute")
_TRANSPOSE = (torch.transpose, "transpose", torch.swapaxes, "swapaxes", torch.swapdims, "swapdims")


def _is(node: Node, targets: tuple) -> bool:
    if node.op == "call_function":
        return any(node.target is t for t in targets if not isinstance(t, str))
    return node.op == "call_method" and node.target in targets


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _op_name(node: Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "get_attr":
        return f"the attribute self.{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _free_name(root: nn.Module, stem: str) -> str:
    i = 0
    while hasattr(root, f"{stem}{i}"):
        i += 1
    return f"{stem}{i}"


def _rewrite(graph: Graph, root: nn.Module) -> None:
    """Turn ``torch.cat`` into :class:`Cat` modules and normalise what BackPACK converts.

    BackPACK's converter turns ``a + b`` into ``SumModule``, ``x * c`` (``c`` a float) into
    ``ScaleModule``, ``flatten`` into ``nn.Flatten`` and ``permute``/``transpose`` into
    ``Permute``; here ``a - b``, ``-x``, ``x / c`` and ``x * 2`` become ``a + (-1.0) * b``,
    ``x * -1.0``, ``x * (1 / c)`` and ``x * 2.0``, and keyword arguments of ``flatten`` and
    ``transpose`` become positional (BackPACK reads positional arguments only). Anything else
    that is not a module call raises.

    Raises:
        NotImplementedError: Listing the operations BackPACK cannot propagate through.
    """
    refused: list[str] = []

    def refuse(node: Node, why: str = "") -> None:
        refused.append(f"{_op_name(node)} (node '{node.name}'){': ' + why if why else ''}")

    def tensors(*args: Any) -> bool:
        return all(isinstance(a, Node) for a in args)

    for node in list(graph.nodes):
        if node.op in ("placeholder", "output", "call_module"):
            continue
        args, kwargs = node.args, dict(node.kwargs)
        # Upstream fix:
        # integration/checks/upstream/backpack/0001-cat-module-and-torch-cat-converter.patch
        if _is(node, _CAT):
            parts = args[0] if args else kwargs.pop("tensors")
            dim = args[1] if len(args) > 1 else kwargs.pop("dim", kwargs.pop("axis", 0))
            if kwargs or not isinstance(parts, (list, tuple)) or not tensors(*parts):
                refuse(node, "only torch.cat(tensors, dim) of computed tensors is supported")
                continue
            name = _free_name(root, "lsn_cat")
            root.add_module(name, Cat(dim))
            node.op, node.target, node.args, node.kwargs = "call_module", name, tuple(parts), {}
        elif _is(node, _ADD):
            if len(args) == 2 and tensors(*args) and kwargs.get("alpha", 1) == 1:
                node.op, node.target, node.args, node.kwargs = (
                    "call_function",
                    operator.add,
                    args,
                    {},
                )
            else:
                refuse(node, "only the sum of two computed tensors is supported")
        elif _is(node, _SUB):
            if len(args) == 2 and tensors(*args) and kwargs.get("alpha", 1) == 1:
                with graph.inserting_before(node):
                    neg = graph.call_function(operator.mul, (args[1], -1.0))
                node.op, node.target, node.args, node.kwargs = (
                    "call_function", operator.add, (args[0], neg), {}
                )  # fmt: skip
            else:
                refuse(node, "only the difference of two computed tensors is supported")
        elif _is(node, _MUL) or _is(node, _DIV) or _is(node, _NEG):
            if _is(node, _NEG) and len(args) == 1 and tensors(*args):
                x, c = args[0], -1.0
            elif len(args) == 2 and not kwargs and _is(node, _DIV) and tensors(args[0]):
                x, c = args[0], 1.0 / args[1] if _number(args[1]) and args[1] != 0 else None
            elif len(args) == 2 and not kwargs and _is(node, _MUL):
                x, c = (args[0], args[1]) if isinstance(args[0], Node) else (args[1], args[0])
                c = c if isinstance(x, Node) and _number(c) else None
            else:
                x, c = None, None
            if c is None:
                refuse(node, "only scaling by a number is supported")
                continue
            node.op, node.target, node.args, node.kwargs = (
                "call_function", operator.mul, (x, float(c)), {}
            )  # fmt: skip
        # Upstream fix:
        # integration/checks/upstream/backpack/0002-converter-flatten-transpose-kwargs.patch
        elif _is(node, _FLATTEN) or _is(node, _TRANSPOSE):
            flat = _is(node, _FLATTEN)
            spec = (("start_dim", 0), ("end_dim", -1)) if flat else (("dim0", None), ("dim1", None))
            rest = list(args[1:]) + [kwargs.pop(k, d) for k, d in spec[len(args) - 1 :]]
            if kwargs or None in rest:
                refuse(node, "unexpected arguments")
                continue
            node.args, node.kwargs = (args[0], *rest), {}
            if not flat:  # BackPACK recognises transpose only
                node.target = torch.transpose if node.op == "call_function" else "transpose"
        elif _is(node, _PERMUTE):
            if kwargs:
                refuse(node, "give the dims positionally")
        else:
            refuse(node)
    if refused:
        raise NotImplementedError(
            "lsn_ext.backpack_ext.convert: BackPACK cannot propagate through these operations "
            f"in forward: {'; '.join(refused)}. Outside modules, forward may use torch.cat, "
            "+, -, multiplication or division by a number, negation, flatten, permute and "
            "transpose. Use modules for the rest (nn.Tanh instead of torch.tanh, nn.Upsample "
            "instead of F.interpolate, nn.Flatten instead of view/reshape). If an operation "
            "only reads shapes, pass example_input. The native engine lsn_ext.diag_backprop "
            "supports more functional operations."
        )


def _check_modules(gm: GraphModule, graph: Graph) -> None:
    """Every called module must have a rule or extension, be a BackPACK leaf, and be used once.

    Raises:
        NotImplementedError: Naming the module's path and class.
    """
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for path, count in calls.items():
        module = gm.get_submodule(path)
        cls = type(module)
        if cls not in RULES and cls not in _EXTRA_CLASSES:
            try:
                get_rule(module, path)
            except NotImplementedError as err:
                raise NotImplementedError(f"lsn_ext.backpack_ext.convert: {err}") from None
        if not BackpackTracer().is_leaf_module(module, path):
            raise NotImplementedError(
                f"lsn_ext.backpack_ext.convert: '{path}' ({cls.__qualname__}) has a rule, but "
                "BackPACK's converter traces into every module class defined outside torch.nn "
                "and BackPACK, so it cannot stay one layer. Build the model from torch.nn "
                "modules, or use backpack.extend(model) without the converter on a model "
                "whose forward BackPACK can follow (nn.Sequential)."
            )
        if count > 1 and any(True for _ in module.parameters()):
            raise NotImplementedError(
                f"lsn_ext.backpack_ext.convert: '{path}' ({cls.__qualname__}) has parameters "
                f"and is called {count} times in forward; BackPACK stores one input per module. "
                "Use separate modules, or the native engine lsn_ext.diag_backprop, which "
                "supports shared modules."
            )


def convert(
    model: nn.Module,
    example_input: Tensor | Sequence[Tensor] | None = None,
    *,
    debug: bool = False,
) -> GraphModule:
    """A BackPACK-ready, extended copy of ``model`` with ``torch.cat`` turned into :class:`Cat`.

    Steps: deep-copy ``model`` (the original is never touched and keeps working with
    ``torch.func``); trace the copy with ``torch.fx``, every module with a rule as one node, and
    if ``example_input`` is given, evaluate ``forward`` on it alongside (so shape checks such as
    ``if x.dim() != 4: raise ...`` run; this uses ``torch.fx.experimental.meta_tracer``);
    replace ``torch.cat`` calls by :class:`Cat` modules and normalise the functions BackPACK
    converts (see below); check that every remaining module is supported; run BackPACK's own
    converter and ``extend`` (``backpack.extend(traced, use_converter=True)``), which also drops
    submodules that forward does not use.

    Functions allowed in ``forward``: ``torch.cat``, ``a + b``, ``a - b``, ``x * c``, ``x / c``
    (``c`` a number), ``-x``, ``flatten``, ``permute`` and ``transpose`` (batch dim first); the
    trace is specialised to the control flow taken for ``example_input``.

    Args:
        model: The network, e.g. :class:`lsn_ext.models.UNet`.
        example_input: An input (or the inputs, in order) like those ``forward`` will see,
            evaluated once without gradients. Needed when ``forward`` inspects shapes.
        debug: Print BackPACK's conversion steps.

    Returns:
        The converted copy, a ``torch.fx.GraphModule`` with hooks installed; its parameters
        have the names of ``model``'s (``model.named_parameters()``; the order may differ) and
        receive ``diag_backprop``. Read them with :func:`diagonals`. Like every module extended
        by BackPACK, it does not work with ``torch.func``.

    Raises:
        NotImplementedError: A module without a rule (with its path), a function in forward
            BackPACK cannot propagate through, a shared module with parameters.
        ValueError: If ``forward`` cannot be traced (e.g. it inspects shapes and no
            ``example_input`` is given, or it branches on tensor values).
    """
    root = copy.deepcopy(model)
    meta = None
    if example_input is not None and MetaTracer is not None:
        inputs = (example_input,) if isinstance(example_input, Tensor) else tuple(example_input)
        names = [
            p.name
            for p in inspect.signature(root.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        # MetaTracer evaluates every node on the tensors it is given: real ones, because leaf
        # modules run with their real parameters (meta inputs fail e.g. in nn.Linear).
        meta = {n: t.detach() for n, t in zip(names, inputs, strict=False)}
    tracer = _Tracer() if meta is None else _ShapeTracer()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # MetaTracer warns for each node it cannot evaluate; that matters only where forward
            # inspects the node's shape, and tracing then fails with an error.
            warnings.filterwarnings("ignore", "Could not compute metadata", UserWarning)
            graph = tracer.trace(root) if meta is None else tracer.trace(root, meta)
    except (TraceError, NameError) as err:
        hint = (
            "forward branches on tensor values, which tracing cannot follow"
            if meta is not None
            else "if forward inspects shapes (x.dim(), x.shape), pass example_input"
        )
        raise ValueError(
            f"lsn_ext.backpack_ext.convert could not trace {type(model).__name__}: {err} ({hint})"
        ) from None
    root = tracer.root
    _rewrite(graph, root)
    traced = GraphModule(root, graph, class_name=type(model).__name__)
    _check_modules(traced, graph)
    converted = extend(traced, debug=debug, use_converter=True)
    leftover = [
        n for n in converted.graph.nodes if n.op not in ("call_module", "placeholder", "output")
    ]
    if leftover:  # pragma: no cover - _rewrite refuses everything BackPACK does not convert
        raise NotImplementedError(f"BackPACK's converter left the operations {leftover}")
    converted.training = model.training
    return converted
