"""Snapshots of a model's complete state, to assert that a function left the model untouched.

``snapshot(model)`` records, for every slot of every module reached under every name
(``named_modules(remove_duplicate=False)``, so aliases are checked separately):

* each parameter: the object, whether it is a leaf ``nn.Parameter``, ``requires_grad``, a copy of
  its values and of its ``.grad`` (``None`` stays ``None``);
* each buffer: the object and a copy of its values;
* the submodules (objects), the ``training`` flag, the instance attributes (a patched
  ``forward`` left behind shows up here) and the hooks registered on the module;
* ``state_dict()``: keys and copies of the values;
* torch's global module hooks.

``assert_unchanged(model, snap)`` compares bit for bit (``torch.equal``) and reports every
difference at once, by path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_mod

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


@dataclass
class _ModuleState:
    module: nn.Module
    training: bool
    attributes: frozenset[str]
    hooks: dict[str, tuple[int, ...]]
    children: dict[str, nn.Module | None]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    buffers: dict[str, tuple[Tensor | None, Tensor | None]] = field(default_factory=dict)


@dataclass
class ModelSnapshot:
    """The state of a model at one time (see the module documentation)."""

    modules: dict[str, _ModuleState]
    state_dict: dict[str, Tensor]
    global_hooks: dict[str, tuple[int, ...]]


def _hook_keys(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {h: tuple(getattr(module, h, {})) for h in _HOOKS}


def snapshot(model: nn.Module) -> ModelSnapshot:
    """Record everything :func:`assert_unchanged` compares (copies of all values)."""
    modules = {}
    for path, module in model.named_modules(remove_duplicate=False):
        state = _ModuleState(
            module=module,
            training=module.training,
            attributes=frozenset(vars(module)),
            hooks=_hook_keys(module),
            children=dict(module._modules),
        )
        for name, p in module._parameters.items():
            state.params[name] = {
                "object": p,
                "is_parameter": isinstance(p, nn.Parameter),
                "is_leaf": None if p is None else p.is_leaf,
                "requires_grad": None if p is None else p.requires_grad,
                "value": _copy(p),
                "grad": None if p is None else _copy(p.grad),
            }
        for name, b in module._buffers.items():
            state.buffers[name] = (b, _copy(b))
        modules[path or "<root>"] = state
    return ModelSnapshot(
        modules=modules,
        state_dict={k: v.detach().clone() for k, v in model.state_dict().items()},
        global_hooks={h: tuple(getattr(module_mod, h)) for h in _GLOBAL_HOOKS},
    )


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    # NaN != NaN: a model with a NaN weight is unchanged if the NaNs are where they were.
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _diff_module(path: str, module: nn.Module, old: _ModuleState) -> list[str]:
    out = []
    if module is not old.module:
        return [f"{path}: a different module object"]
    if module.training != old.training:
        out.append(f"{path}: training {old.training} -> {module.training}")
    attributes = frozenset(vars(module))
    if attributes != old.attributes:
        added, removed = sorted(attributes - old.attributes), sorted(old.attributes - attributes)
        out.append(f"{path}: instance attributes added {added}, removed {removed}")
    if _hook_keys(module) != old.hooks:
        out.append(f"{path}: hooks {old.hooks} -> {_hook_keys(module)}")
    children = dict(module._modules)
    if children.keys() != old.children.keys() or any(
        children[k] is not v for k, v in old.children.items()
    ):
        out.append(f"{path}: submodules replaced or added")
    if module._parameters.keys() != old.params.keys():
        out.append(f"{path}: parameters {list(old.params)} -> {list(module._parameters)}")
    for name, rec in old.params.items():
        p, where = module._parameters.get(name), f"{path}.{name}"
        if p is not rec["object"]:
            out.append(f"{where}: replaced by a {type(p).__name__} (was the original Parameter)")
        if p is None:
            continue
        if not isinstance(p, nn.Parameter) and rec["is_parameter"]:
            out.append(f"{where}: no longer an nn.Parameter")
        if p.is_leaf != rec["is_leaf"]:
            out.append(f"{where}: is_leaf {rec['is_leaf']} -> {p.is_leaf}")
        if p.requires_grad != rec["requires_grad"]:
            out.append(f"{where}: requires_grad {rec['requires_grad']} -> {p.requires_grad}")
        if not _same(p.detach(), rec["value"]):
            out.append(f"{where}: values changed")
        if not _same(p.grad, rec["grad"]):
            out.append(f"{where}: .grad changed")
    if module._buffers.keys() != old.buffers.keys():
        out.append(f"{path}: buffers {list(old.buffers)} -> {list(module._buffers)}")
    for name, (obj, value) in old.buffers.items():
        b, where = module._buffers.get(name), f"{path}.{name}"
        if b is not obj:
            out.append(f"{where}: buffer object replaced")
        elif not _same(None if b is None else b.detach(), value):
            out.append(f"{where}: buffer values changed")
    return out


def differences(model: nn.Module, snap: ModelSnapshot) -> list[str]:
    """Everything that differs between ``model`` now and ``snap``, one line each."""
    out = []
    now = dict(model.named_modules(remove_duplicate=False))
    paths = {p or "<root>" for p in now}
    if paths != snap.modules.keys():
        out.append(f"module paths changed: {sorted(paths ^ snap.modules.keys())}")
    for path, old in snap.modules.items():
        module = now.get("" if path == "<root>" else path)
        if module is not None:
            out.extend(_diff_module(path, module, old))
    state = model.state_dict()
    if list(state) != list(snap.state_dict):
        out.append(f"state_dict keys changed: {sorted(set(state) ^ set(snap.state_dict))}")
    out.extend(
        f"state_dict[{k!r}] changed"
        for k, v in snap.state_dict.items()
        if k in state and not _same(state[k].detach(), v)
    )
    hooks = {h: tuple(getattr(module_mod, h)) for h in _GLOBAL_HOOKS}
    if hooks != snap.global_hooks:
        out.append(f"global module hooks {snap.global_hooks} -> {hooks}")
    return out


def assert_unchanged(model: nn.Module, snap: ModelSnapshot) -> None:
    """Fail, listing every difference, unless ``model`` is exactly as in ``snap``."""
    diffs = differences(model, snap)
    assert not diffs, "the model was modified:\n  " + "\n  ".join(diffs)
