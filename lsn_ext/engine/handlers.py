"""The table of functional handlers: how the session routes operations in ``forward``.

:data:`HANDLERS` maps the name of a torch function to the handler that runs it as a DB node:
``F.avg_pool*d``, global adaptive average pooling, ``F.interpolate``, dropout in evaluation
mode, and constant scaling (``c * x``, ``x / c``, ``-x``, ``a - b``, ``mean``) or products of
two branches. :func:`handler_table` adds the functional forms of the registered rules
(``F.tanh``, ``F.silu``, …: :func:`lsn_ext.rules.functional_forms`, each run as a node of its
module's rule) for one pass. :data:`STRUCTURAL` lists the operations whose Jacobian has only
0/1 entries, for which autograd's own backward already is the DB step; those without a handler
the session runs untouched.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lsn_ext.engine.functions import ProductFunction, ScaleFunction
from lsn_ext.rules import AvgPoolRule, Functional, Rule, UpsampleRule, functional_forms

if TYPE_CHECKING:
    from lsn_ext.engine.session import Session

__all__ = [
    "HANDLERS",
    "STRUCTURAL",
    "bind_arguments",
    "handler_table",
    "needs_grad",
]


def _inplace(name: str) -> bool:
    """``mul_`` is in place; ``__rsub__`` is not."""
    return name.endswith("_") and not name.endswith("__")


def needs_grad(tree: Any) -> bool:
    """Whether any tensor in ``tree`` (nested tuples, lists, dicts) requires grad."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(tree))


def bind_arguments(args: tuple, kwargs: dict, spec: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Bind ``(input, *rest)`` to ``spec``'s names with defaults."""
    bound = {"input": args[0] if args else kwargs["input"]}
    for (name, default), value in itertools.zip_longest(spec, args[1:], fillvalue=_MISSING):
        if name is _MISSING:
            raise TypeError("too many positional arguments")
        bound[name] = value if value is not _MISSING else kwargs.get(name, default)
    return bound


_MISSING = object()


def _functional(form: Functional, rule: Rule, session: Session, func, args, kwargs) -> Tensor:
    """A rule's functional form as a node of the rule, on the equivalent module.

    An in-place call (``F.silu(x, inplace=True)``, as in MONAI's EfficientNet blocks) runs as
    the in-place module, which the rule node handles like ``nn.SiLU(inplace=True)``.
    """
    bound = bind_arguments(args, kwargs, form.arguments)
    module = form.module(**{k: v for k, v in bound.items() if k != "input"})
    return session.apply_rule(module, rule, bound["input"], module)


_POOL_SPEC = (
    ("kernel_size", None),
    ("stride", None),
    ("padding", 0),
    ("ceil_mode", False),
    ("count_include_pad", True),
    ("divisor_override", None),
)


def _avg_pool(session: Session, func, args, kwargs) -> Tensor:
    dims = int(func.__name__[-2])
    bound = bind_arguments(args, kwargs, _POOL_SPEC[: 5 if dims == 1 else 6])
    x = bound.pop("input")
    module = getattr(nn, f"AvgPool{dims}d")(**bound)
    return session.apply_rule(module, AvgPoolRule(), x, module)


def _adaptive_avg_pool(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, (("output_size", None),))
    x, size = bound["input"], bound["output_size"]
    dims = int(func.__name__[-2])
    sizes = [size] * dims if isinstance(size, int) else list(size)
    if any(s != 1 for s in sizes):
        raise session.unsupported(
            func.__name__, "Only global pooling (output size 1) is supported; use nn.AvgPool."
        )
    return _mean(session, torch.mean, (x, tuple(range(-dims, 0)), True), {})


_INTERPOLATE_SPEC = (
    ("size", None),
    ("scale_factor", None),
    ("mode", "nearest"),
    ("align_corners", None),
    ("recompute_scale_factor", None),
    ("antialias", False),
)


def _interpolate(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, _INTERPOLATE_SPEC)
    if bound["mode"] in ("nearest", "nearest-exact"):
        return func(*args, **kwargs)
    if bound["antialias"]:
        raise session.unsupported("interpolate", "antialias=True has no module form; use False.")
    module = nn.Upsample(
        bound["size"],
        bound["scale_factor"],
        bound["mode"],
        bound["align_corners"],
        bound["recompute_scale_factor"],
    )
    return session.apply_rule(module, UpsampleRule(), bound["input"], module)


def _dropout(session: Session, func, args, kwargs) -> Tensor:
    bound = bind_arguments(args, kwargs, (("p", 0.5), ("training", True), ("inplace", False)))
    if bound["training"] and bound["p"] > 0:
        raise session.unsupported(
            func.__name__,
            "Dropout in training mode has a random Jacobian; call model.eval() or pass "
            "training=self.training.",
        )
    return func(*args, **kwargs)


def _scale(session: Session, x: Tensor, c: Tensor | float, compute: Callable[[], Tensor]):
    if isinstance(c, Tensor) and c.requires_grad:
        raise session.unsupported("mul", "Both factors of a product depend on parameters.")
    return ScaleFunction.apply(x, c.detach() if isinstance(c, Tensor) else c, compute)


def _grad_tensor(t: Any) -> bool:
    return isinstance(t, Tensor) and t.requires_grad


def _mul(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _grad_tensor(a) and _grad_tensor(b):
        if _inplace(func.__name__):
            raise session.unsupported(func.__name__, "Write y = a * b instead of a *= b.")
        return ProductFunction.apply(a, b, lambda: func(*args, **kwargs))
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write x = x * c instead of scaling in place.")
    if isinstance(a, Tensor) and a.requires_grad:
        x, c = a, b
    else:
        x, c = b, a
    return _scale(session, x, c, lambda: func(*args, **kwargs))


def _div(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _inplace(func.__name__) or kwargs.get("rounding_mode") is not None:
        raise session.unsupported(func.__name__, "Write x = x / c (true division).")
    if isinstance(b, Tensor) and b.requires_grad:
        raise session.unsupported(func.__name__, "The divisor depends on parameters.")
    return _scale(session, a, 1.0 / b, lambda: func(*args, **kwargs))


def _neg(session: Session, func, args, kwargs) -> Tensor:
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write x = -x instead.")
    return _scale(session, args[0], -1.0, lambda: func(*args, **kwargs))


def _sub(session: Session, func, args, kwargs) -> Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    alpha = kwargs.get("alpha", 1)
    if func.__name__ in ("rsub", "__rsub__"):
        a, b = b, a
    if not (isinstance(b, Tensor) and b.requires_grad) and alpha == 1:
        return func(*args, **kwargs)
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write a = a - b instead of subtracting in place.")
    neg_b = _scale(session, b, -alpha, lambda: b * -alpha)
    return torch.add(neg_b, a)


def _add(session: Session, func, args, kwargs) -> Tensor:
    alpha = kwargs.get("alpha", 1)
    if alpha == 1:
        return func(*args, **kwargs)
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if _inplace(func.__name__):
        raise session.unsupported(func.__name__, "Write a = a + alpha * b instead.")
    return torch.add(a, _scale(session, b, alpha, lambda: b * alpha))


def _mean(session: Session, func, args, kwargs) -> Tensor:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    total = x.sum() if dim is None else x.sum(dim, keepdim=keepdim)
    n = x.numel() // max(total.numel(), 1)
    return _scale(session, total, 1.0 / n, lambda: total * (1.0 / n))


HANDLERS: dict[str, Callable[..., Tensor]] = {
    **dict.fromkeys(("avg_pool1d", "avg_pool2d", "avg_pool3d"), _avg_pool),
    **dict.fromkeys(
        ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"), _adaptive_avg_pool
    ),
    "interpolate": _interpolate,
    **dict.fromkeys(("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"), _dropout),
    **dict.fromkeys(("mul", "multiply", "mul_"), _mul),
    **dict.fromkeys(("div", "divide", "true_divide", "div_"), _div),
    **dict.fromkeys(("neg", "negative", "neg_"), _neg),
    **dict.fromkeys(("sub", "subtract", "rsub", "__rsub__", "sub_"), _sub),
    **dict.fromkeys(("add", "add_"), _add),
    "mean": _mean,
}

# Operations whose Jacobian w.r.t. every input has only 0/1 entries: autograd's backward is the
# DB step. (Negation and subtraction are not: their −1 must become +1, see _sub and _neg.)
STRUCTURAL = frozenset(
    {
        # joining and splitting
        "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "split",
        "split_with_sizes", "tensor_split", "chunk", "unbind", "narrow", "select",
        # indexing
        "__getitem__", "__setitem__", "index_select", "gather", "take", "take_along_dim",
        "masked_select", "masked_fill", "masked_fill_", "where", "scatter", "scatter_add",
        "index_add", "index_copy", "index_put", "index_put_", "diagonal", "triu", "tril",
        # shapes and copies
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "squeeze",
        "squeeze_", "unsqueeze", "unsqueeze_", "permute", "transpose", "transpose_", "swapaxes",
        "swapdims", "t", "movedim", "moveaxis", "contiguous", "clone", "expand", "expand_as",
        "broadcast_to", "repeat", "tile", "repeat_interleave", "flip", "fliplr", "flipud",
        "roll", "rot90", "pad", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "unfold",
        "fold", "__get__", "copy_", "fill_", "zero_", "to", "type", "float", "double", "half",
        "bfloat16", "cpu", "cuda", "detach", "requires_grad_",
        # sums, selections and 0/1 derivatives
        "add", "add_", "sum", "relu", "relu_", "relu6", "hardtanh", "hardtanh_", "threshold",
        "clamp", "clamp_", "clip", "max", "min", "amax", "amin", "maximum", "minimum", "sort",
        "topk", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
        "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
        "adaptive_max_pool2d", "adaptive_max_pool3d", "interpolate", "max_unpool1d",
        "max_unpool2d", "max_unpool3d", "as_tensor",
    }
)  # fmt: skip


def handler_table() -> tuple[dict[str, Callable[..., Tensor]], tuple[str, ...]]:
    """The handlers of one pass: :data:`HANDLERS` and the rules' functional forms.

    Returns:
        ``(handlers, names)``: function name → handler, and the sorted names of the functional
        forms (for error messages).

    Raises:
        ValueError: If a rule's functional form takes the name of one of :data:`HANDLERS`
            (``mul``, ``interpolate``, …), or two rules claim one name.
    """
    forms = functional_forms()
    taken = sorted(forms.keys() & HANDLERS.keys())
    if taken:
        raise ValueError(
            f"the functional forms {taken} of the rules of "
            f"{[forms[n][0].module.__qualname__ for n in taken]} take names of the native "
            "engine's own handlers; give those rules other functional forms (Rule.functional)"
        )
    by_form = {name: functools.partial(_functional, *forms[name]) for name in forms}
    return {**by_form, **HANDLERS}, tuple(sorted(forms))
