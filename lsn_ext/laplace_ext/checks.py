"""Argument checks of the laplace-torch glue: clear errors before any work.

The images (:func:`check_images`), dictionary batches (:func:`dict_input`), the model's modes and
trainable parameters, the loader before laplace-torch's ``fit``, a fitted posterior and the
parameters it covers (:func:`trainable_params`), and the options of the predictives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lsn_ext import distributed as _dist
from lsn_ext._laplace import BaseLaplace
from lsn_ext.outputs import SelectInput

__all__ = [
    "check_before_laplace_fit",
    "check_choice",
    "check_eval_norms",
    "check_finite",
    "check_fitted",
    "check_images",
    "check_n_samples",
    "check_trainable",
    "dict_input",
    "trainable_params",
]

_NORMS_WITH_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def check_finite(name: str, t: Tensor) -> None:
    """Raise a ``ValueError`` if a floating-point ``t`` holds NaN or infinite values.

    Args:
        name: What ``t`` is, for the message (e.g. ``"the batch's targets"``).
        t: Any tensor; integer tensors always pass.

    Raises:
        ValueError: If ``t`` holds NaN or infinite values, naming how many.
    """
    if (t.is_floating_point() or t.is_complex()) and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} holds {bad} NaN or infinite value(s); "
            "clean or mask them before calling"
        )


def dict_input(model: nn.Module, batch: Mapping[str, Any], key: str, who: str) -> Tensor:
    """The images ``batch[key]`` of a dictionary batch for a ``SelectInput(model, key)``.

    Args:
        model: The network the batch is for.
        batch: A dictionary batch (MONAI's ``{"image": ..., "label": ...}``).
        key: The key of the images (laplace-torch's ``dict_key_x``).
        who: The caller, for the message.

    Returns:
        ``batch[key]``, e.g. ``[N, C, *spatial]``.

    Raises:
        ValueError: If the model is not a ``SelectInput`` (laplace-torch passes dictionaries
            whole to the model, which the engines cannot split into samples), its key differs
            from ``key``, or the batch lacks ``key``.
    """
    keys = sorted(map(str, batch))
    if not isinstance(model, SelectInput):
        raise ValueError(
            f"{who} got a dictionary batch (keys {keys}) for a {type(model).__name__}, which "
            "takes it whole; the curvature and predictives run the model on one image tensor. "
            "Wrap the network: Laplace(lsn_ext.SelectInput(net, 'image'), ..., "
            "dict_key_x='image', dict_key_y='label') (MONAI's keys), or give (x, y) batches"
        )
    if model.key != key:
        raise ValueError(
            f"SelectInput takes the key {model.key!r} but dict_key_x is {key!r}: give "
            f"Laplace(..., dict_key_x={model.key!r}) (or SelectInput(net, {key!r}))"
        )
    if key not in batch:
        raise ValueError(f"the batch has no key dict_key_x={key!r} (keys: {keys})")
    return batch[key]


def check_images(x: Any, name: str = "x") -> Tensor:
    """``x`` if it is a finite tensor ``[N, …]`` with ``N ≥ 1``; otherwise a clear error.

    Args:
        x: The images.
        name: What ``x`` is, for the message.

    Returns:
        ``x`` unchanged.

    Raises:
        TypeError: If ``x`` is not a tensor.
        ValueError: If ``x`` has no batch axis, an empty batch or NaN/inf values.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor [N, C_in, *spatial], got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty batch [N, ...], got shape {tuple(x.shape)}")
    check_finite(name, x)
    return x


def check_eval_norms(model: nn.Module, what: str) -> None:
    """Refuse normalisation layers with running statistics in training mode.

    Args:
        model: The network.
        what: The caller, for the message.

    Raises:
        ValueError: Naming the first batch or instance norm with ``track_running_stats`` that
            is in training mode.
    """
    for path, module in model.named_modules():
        if isinstance(module, _NORMS_WITH_STATS) and module.training and module.track_running_stats:
            raise ValueError(
                f"{what} needs the model in eval mode, but {path or '<root>'} "
                f"({type(module).__name__}) is in training mode: it would normalise with the "
                "batch's statistics (and training-mode statistics are not what the posterior was "
                "fitted with). Call model.eval() first; lsn_ext never changes the model's mode"
            )


def check_trainable(model: nn.Module) -> None:
    """Refuse a model without parameters, or with every parameter frozen, naming which.

    Args:
        model: The network.

    Raises:
        ValueError: For a model without parameters or without one with ``requires_grad``.
    """
    tensors = list(model.parameters())
    if not tensors:
        raise ValueError(
            f"{type(model).__name__} has no parameters at all: there are no weights to put a "
            "Laplace approximation on (a network with learnable layers is needed)"
        )
    if not any(p.requires_grad for p in tensors):
        raise ValueError(
            f"all {len(tensors)} parameter tensors of {type(model).__name__} are frozen "
            "(requires_grad=False): the posterior is over the parameters with requires_grad=True, "
            "and there are none. Unfreeze the ones it should cover (model.requires_grad_(True), "
            "or only some layers for a subnetwork Laplace)"
        )


def check_before_laplace_fit(model: nn.Module, train_loader: Any) -> None:
    """Errors that laplace-torch's ``fit`` raises before any backend runs, made clear.

    laplace-torch builds its backend lazily, on the first batch, after ``fit`` has already
    flattened the trainable parameters with ``parameters_to_vector`` (``torch.cat`` of nothing
    for a frozen model, ``.view(-1)`` of a channels_last weight) and taken ``next(iter(
    train_loader))`` (``StopIteration`` for a loader without batches): ``DiagBackprop`` cannot
    intercept these. lsn_ext's own entry points that call ``fit`` check them first with this.

    Args:
        model: The network the posterior is over.
        train_loader: The loader ``fit`` will iterate.

    Raises:
        ValueError: For a model without trainable parameters, a trainable parameter that is
            not contiguous (channels_last), or a loader of length 0.
    """
    check_trainable(model)
    for name, p in model.named_parameters():
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(
                f"parameter {name} {tuple(p.shape)} is not contiguous (a channels_last model?): "
                "laplace-torch's fit flattens the parameters with .view(-1), which fails on it "
                "('view size is not compatible'). Fit with "
                "model.to(memory_format=torch.contiguous_format); convert back afterwards if "
                "you like (lsn_ext.predict runs on either memory format)"
            )
    if hasattr(train_loader, "__len__") and len(train_loader) == 0:
        dataset = getattr(train_loader, "dataset", None)
        what = f"its dataset has {len(dataset)} samples" if dataset is not None else "empty"
        raise ValueError(
            f"train_loader yields no batches ({what}, batch_size="
            f"{getattr(train_loader, 'batch_size', None)}, drop_last="
            f"{getattr(train_loader, 'drop_last', None)}): nothing to fit the posterior on "
            "(laplace-torch's fit would raise a bare StopIteration). Use a smaller batch size "
            "or drop_last=False"
        )


def trainable_params(la: Any) -> list[tuple[str, Tensor]]:
    """The model's parameters with ``requires_grad``, checked against those the posterior covers.

    A laplace-torch posterior covers the parameters that had ``requires_grad=True`` when it was
    created (``la.params``); one frozen or unfrozen since is named.

    Args:
        la: A fitted posterior (laplace-torch ``Laplace`` or
            :class:`~lsn_ext.VariationalPosterior`).

    Returns:
        ``(name, parameter)`` pairs in ``model.named_parameters()`` order, ``P`` entries
        together.

    Raises:
        ValueError: A parameter whose ``requires_grad`` changed since the posterior was created,
            or (for posteriors that do not list their tensors) another number of trainable
            entries than ``la.n_params``.
    """
    model = _dist.unwrap(la.model)
    everything = list(model.named_parameters())
    named = [(n, p) for n, p in everything if p.requires_grad]
    covered = getattr(la, "params", None)
    if isinstance(covered, list) and all(isinstance(p, Tensor) for p in covered):
        ids = {id(p) for p in covered}
        for n, p in everything:
            if p.requires_grad == (id(p) in ids):
                continue
            if p.requires_grad:
                raise ValueError(
                    f"parameter {n!r} has requires_grad=True now but was frozen when the "
                    "posterior was fitted, so the posterior has no variance for it. Freeze it "
                    f"again for the predictive (model.get_parameter({n!r})."
                    "requires_grad_(False)), or fit a new Laplace with it trainable"
                )
            raise ValueError(
                f"parameter {n!r} has requires_grad=False now but was trainable when the "
                "posterior was fitted, and the posterior covers it. Make it trainable again for "
                f"the predictive (model.get_parameter({n!r}).requires_grad_(True)), or fit a new "
                "Laplace after freezing it"
            )
    total = sum(p.numel() for _, p in named)
    if total != la.n_params:
        raise ValueError(
            f"the model has {total} trainable parameter entries (requires_grad=True) but the "
            f"posterior covers {la.n_params}: a parameter was frozen or unfrozen since the "
            "posterior was created. Restore requires_grad as it was then, or build a new "
            "posterior"
        )
    return named


def check_fitted(la: Any) -> None:
    """Refuse anything but a posterior (``sample``, ``model``, ``n_params``), or an unfitted ``la``.

    Args:
        la: The object passed as a posterior.

    Raises:
        TypeError: For an object without the posterior's attributes.
        ValueError: For a laplace-torch ``Laplace`` that has not been fitted.
    """
    if not all(hasattr(la, a) for a in ("sample", "model", "n_params")):
        raise TypeError(
            "expected a fitted laplace-torch Laplace object or a posterior with model, "
            f"n_params, sample(n, generator=) and link; got {type(la).__name__}"
        )
    fitted = getattr(la, "H", None) is not None and getattr(la, "n_data", 0) > 0
    if isinstance(la, BaseLaplace) and not fitted:
        raise ValueError("the Laplace object is not fitted yet: call la.fit(train_loader) first")


def check_n_samples(n_samples: Any) -> None:
    """Refuse a number of samples that is not an int of at least 2.

    Args:
        n_samples: The number of posterior draws asked for.

    Raises:
        ValueError: For a non-int (``bool`` included) or a value below 2 (no variance).
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 2:
        raise ValueError(
            f"n_samples must be an int of at least 2 to estimate a variance, got {n_samples!r}"
        )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Refuse an option ``name=value`` that is not one of ``choices``.

    Args:
        name: The option's name, for the message.
        value: The value given.
        choices: The accepted values.

    Raises:
        ValueError: If ``value`` is not in ``choices``, listing them.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
