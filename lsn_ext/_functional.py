"""Run a model with substituted parameters and buffers, leaving the model itself untouched.

Every place in lsn_ext that evaluates a whole network at other parameter values (posterior
samples, dual tensors, detached copies) goes through :func:`functional_call_all` (the per-sample
replay in :mod:`lsn_ext.estimators` runs single leaf modules, which hold no aliases), a wrapper of
:func:`torch.func.functional_call` that is safe for the two kinds of sharing found in
segmentation networks:

* **One module under two names** (MONAI's ``DynUNet`` keeps its blocks both in ``skip_layers``
  and in ``input_block``/``downsamples``/…; every network of ``dynamic_network_architectures``
  holds its encoder as ``encoder`` and as ``decoder.encoder``). ``named_parameters()`` lists the
  parameter once, ``named_parameters(remove_duplicate=False)`` once per path. Both paths lead to
  the *same slot* (the same entry of the same module's ``_parameters``). ``functional_call``'s
  default ``tie_weights=True`` adds every path, swaps the slot twice and restores it wrongly:
  afterwards the module holds the substituted tensor instead of its ``nn.Parameter`` (PyTorch
  issue 164759), silently and permanently.
* **Weights tied across modules** (``b.weight = a.weight``): different slots hold the same
  ``nn.Parameter``. Substituting only the name ``named_parameters()`` reports would leave the
  other module at the old value.

:func:`functional_call_all` substitutes a given tensor in every *slot* that holds the original
(exactly one path per slot) and calls ``functional_call`` with ``tie_weights=False``, so each slot
is swapped once and restored once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["functional_call_all", "unflatten"]


def _slots(model: nn.Module) -> tuple[dict[str, Tensor], dict[int, list[str]]]:
    """Every path to a parameter or buffer, and one path per slot for each tensor.

    Returns:
        ``(tensor_of, paths_of)``: ``tensor_of`` maps every path (aliases included, as in
        ``named_parameters(remove_duplicate=False)``) to its tensor; ``paths_of`` maps
        ``id(tensor)`` to one path per distinct ``(module, attribute)`` slot holding it.
    """
    tensor_of: dict[str, Tensor] = {}
    paths_of: dict[int, list[str]] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None:
                    continue
                path = f"{prefix}.{name}" if prefix else name
                tensor_of[path] = tensor
                slot = (id(module), name)
                if slot not in seen:
                    seen.add(slot)
                    paths_of.setdefault(id(tensor), []).append(path)
    return tensor_of, paths_of


def expand_aliases(model: nn.Module, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map each substituted tensor to one path per slot that holds the original.

    Args:
        model: The network.
        tensors: ``{path: new value}`` for parameters or buffers of ``model``; any path to a
            tensor may be given (usually the names of ``named_parameters()``).

    Returns:
        ``{path: new value}`` with exactly one path per ``(module, attribute)`` slot: a slot
        reached under several names appears once, a tensor shared by several modules once per
        module.

    Raises:
        ValueError: If a path is not a parameter or buffer of ``model``, or two paths to the same
            tensor are given different values.
    """
    tensor_of, paths_of = _slots(model)
    expanded: dict[str, Tensor] = {}
    given_by: dict[str, str] = {}
    for name, value in tensors.items():
        if name not in tensor_of:
            raise ValueError(
                f"{name!r} is not a parameter or buffer of {type(model).__name__}; its "
                f"parameters are {[n for n, _ in model.named_parameters()]}"
            )
        for path in paths_of[id(tensor_of[name])]:
            if path in expanded and expanded[path] is not value:
                raise ValueError(
                    f"{given_by[path]!r} and {name!r} name the same tensor of "
                    f"{type(model).__name__} but were given different values"
                )
            expanded[path] = value
            given_by[path] = name
    return expanded


def functional_call_all(
    model: nn.Module,
    tensors: Mapping[str, Tensor],
    args: Any,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """``model(*args, **kwargs)`` with ``tensors`` in place of its parameters and buffers.

    A safe :func:`torch.func.functional_call`: each given tensor replaces the original in every
    slot that holds it (modules registered under two names, weights tied across modules), each
    slot is swapped exactly once (``tie_weights=False``), and all slots are restored afterwards,
    also when ``model`` raises. Parameters and buffers not in ``tensors`` keep their values.
    Works under :func:`torch.func.vmap`, :func:`torch.func.grad` and forward-mode AD like
    ``functional_call`` itself.

    Args:
        model: The network; left unchanged (its own in-place updates of buffers that are not
            substituted, e.g. train-mode batch norm, are the caller's business).
        tensors: ``{name: value}``; names as in ``named_parameters()`` / ``named_buffers()``
            (or any alias path), values shaped like the originals.
        args: Positional arguments of ``forward``: a tuple, or a single non-tuple argument.
        kwargs: Keyword arguments of ``forward``.

    Returns:
        Whatever ``model`` returns.

    Raises:
        ValueError: As :func:`expand_aliases`.
    """
    expanded = expand_aliases(model, tensors)
    return functional_call(model, expanded, args, kwargs, tie_weights=False, strict=False)


def unflatten(
    named: Sequence[tuple[str, Tensor]], theta: Tensor, prefix: str = ""
) -> dict[str, Tensor]:
    """A flat parameter vector as ``{prefix + name: slice}`` for :func:`functional_call_all`.

    Args:
        named: ``(name, parameter)`` pairs; ``theta`` concatenates them in this order.
        theta: ``[P]`` with ``P`` the parameters' total size.
        prefix: Put before every name (e.g. ``"ssn."`` for a wrapper module).

    Returns:
        Views of ``theta`` shaped like the parameters.
    """
    sizes = [p.numel() for _, p in named]
    return {prefix + n: t.view_as(p) for (n, p), t in zip(named, theta.split(sizes), strict=True)}
