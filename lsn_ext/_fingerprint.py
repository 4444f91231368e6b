"""What a cached Monte-Carlo plan rests on, read off a model in one cheap walk.

The Monte-Carlo estimator (:mod:`lsn_ext.estimators`) verifies its capture on the first call per
model and input signature and then takes a faster path that trusts what that call found (which
module calls deliver per-sample gradients, which parameters go through the whole model, that
no module mixes the samples). Everything that finding depends on, and that can change between
two calls without changing the input's shapes, is part of :func:`fingerprint`:

- each module's identity and class (a submodule swapped, even for a subclass at the same path;
  a parametrization, which changes the class), its ``training`` flag (``model.train()``: a layer
  that centres over the batch only in training), and an instance-level ``forward`` override;
- the hooks registered on each module (forward, forward-pre, backward, backward-pre; their
  handle ids, which torch never reuses, so a hook removed and registered again counts as new);
- which parameter tensors each module holds (a weight tied or replaced after the first call);
- torch's global module hooks (``register_module_forward_hook`` and its kin) and whether a
  ``torch.func`` transform is active.

A fingerprint holds only ids, classes, flags and integers, never a module or a tensor, so that
a cache keyed by it does not keep the model alive. What it cannot see: arithmetic inside a
``forward`` that changes with the data. The estimator covers that by the module calls it
records per call (a branch taken only on later inputs calls other modules) and by checking,
every call, that the backward pass reached the same module calls as the verified one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["fingerprint", "global_forward_hooks"]


def fingerprint(modules: Sequence[nn.Module]) -> tuple:
    """A hashable summary of everything about ``modules`` that a cached plan rests on.

    Args:
        modules: The model's modules, each once (``lsn_ext.engine``'s walk of the model).

    Returns:
        A tuple equal for two calls exactly when no module was swapped, retyped, put in another
        mode, given or relieved of a hook or a parameter tensor, and no global module hook or
        ``torch.func`` transform level changed in between (see the module documentation).
    """
    per_module = tuple(
        (
            id(m),
            type(m),
            m.training,
            tuple(m._forward_hooks),
            tuple(m._forward_pre_hooks),
            tuple(m._backward_hooks),
            tuple(m._backward_pre_hooks),
            id(m.__dict__.get("forward")),
            tuple(map(id, m._parameters.values())),
        )
        for m in modules
    )
    return per_module, _global_hooks(), torch._C._functorch.maybe_current_level()


def global_forward_hooks() -> bool:
    """Whether torch's global forward hooks are registered (``register_module_forward_hook``).

    They run before a module's own forward hooks, so they can change a module's output before
    any hook of the estimator sees it, differently on every call.
    """
    return bool(_module._global_forward_hooks)


def _global_hooks() -> tuple:
    return (
        tuple(_module._global_forward_hooks),
        tuple(_module._global_forward_pre_hooks),
        tuple(_module._global_backward_hooks),
        tuple(_module._global_backward_pre_hooks),
    )
