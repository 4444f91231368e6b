r"""The output layer of a network as a last layer: its per-position features and exact GGN.

A last-layer Laplace approximation treats only the *head*, the layer that produces the logits,
probabilistically. For a segmentation network the head is a convolution (``1×1`` or ``k×k``,
1–3-D, possibly transposed) or a ``Linear`` on tokens; laplace-torch 0.3 accepts ``nn.Linear``
only. Every such head is linear in its parameters: at each output position ``p`` (a pixel, a
voxel, a token) of sample ``n``

.. math:: f_{n,c,p} = \sum_d W_{c,d}\, \phi_{n,d,p} + b_c = (e_c \otimes \tilde\phi_{n,p})^\top
          \theta, \qquad \tilde\phi = [\phi; 1],

with ``φ`` the head's input at ``p`` (``Linear``: the input vector; convolutions: the input patch
``C_in·∏k``, im2col). So its Jacobian is ``J_{n,p} = I_C ⊗ φ̃_{n,p}ᵀ`` in the *canonical*
parameter order ``θ = [W | b]`` (``[C, D + 1]``, row ``c`` = output channel ``c``'s weights
then its bias), and everything (the GGN, the predictive) follows in closed form from ``φ̃``.

- :func:`find_head`: the head by one forward pass (the last layer with parameters to run, as
  laplace-torch's ``FeatureExtractor.find_last_layer`` finds its ``nn.Linear``).
- :func:`capture_head`: one batch's features ``φ̃ [N, D̃, P]`` and logits, with two checks that
  make the closed forms exact or refuse: the logits are the head's output (channels first, or
  a ``Linear``'s channels-last output moved to dim 1), and the head's output equals ``W φ + b``.
- :func:`head_permutation`: canonical order → laplace-torch's ``parameters_to_vector`` order.
- :func:`head_curvature`: the batch's ``(loss, H)`` as laplace-torch's backends return them for
  ``full``, ``diag`` and ``kron`` (module :mod:`lsn_ext.laplace_ext.head_curvature`).

Features come from the head itself: the call is replayed with a *basis* weight (the identity
over ``C_in·∏k`` output channels), so stride, padding (any ``padding_mode``), dilation and a
transposed convolution's ``output_size``/``output_padding`` are those of the network's own call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lsn_ext._laplace import laplace
from lsn_ext.outputs import plain_tensor

__all__ = [
    "CONV_HEADS",
    "HEAD_TYPES",
    "TRANSPOSED_HEADS",
    "HeadBatch",
    "HeadError",
    "HeadFeatureExtractor",
    "capture_head",
    "check_head",
    "find_head",
    "head_permutation",
]

CONV_HEADS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_HEADS: tuple[type[nn.Module], ...] = (
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
HEAD_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, *CONV_HEADS, *TRANSPOSED_HEADS)
_NAMES = "Linear, Conv1d/2d/3d or ConvTranspose1d/2d/3d"
FeatureExtractor = laplace.utils.feature_extractor.FeatureExtractor


class HeadError(ValueError):
    """A network whose last layer cannot be the head of a last-layer Laplace approximation."""


def _describe(module: nn.Module, name: str) -> str:
    weight = getattr(module, "weight", None)
    shape = f", weight {list(weight.shape)}" if isinstance(weight, Tensor) else ""
    return f"'{name}' ({type(module).__name__}{shape})"


def check_head(module: nn.Module, name: str) -> None:
    """Refuse a module that cannot be a head: its type, groups, frozen or missing parameters.

    Raises:
        HeadError: For a module that is not one of :data:`HEAD_TYPES`, a convolution with
            ``groups > 1``, or a head with a frozen parameter.
    """
    if not isinstance(module, HEAD_TYPES):
        raise HeadError(
            f"the last layer {_describe(module, name)} is not a {_NAMES} layer: a last-layer "
            "Laplace approximation needs the layer that produces the logits to be linear in its "
            "parameters. Name the head with last_layer_name='...' (a module of "
            "model.named_modules()), or use subset_of_weights='all'"
        )
    if getattr(module, "groups", 1) != 1:
        raise HeadError(
            f"the head {_describe(module, name)} has groups={module.groups}; last-layer "
            "Laplace supports heads with groups=1 only (use subset_of_weights='all')"
        )
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise HeadError(
            f"the head {_describe(module, name)} has frozen parameters {frozen} "
            "(requires_grad=False); the last-layer posterior covers all of the head's "
            "parameters: unfreeze them (head.requires_grad_(True))"
        )


def find_head(network: nn.Module, x: Any) -> str:
    """The name of the last module with parameters of its own to run in ``network(x)``.

    Hooks every module that holds parameters itself (not through children) and runs one
    forward pass without gradients; the last one to finish is the head candidate, which
    :func:`check_head` and then :func:`capture_head` validate.

    Raises:
        HeadError: If no module with parameters runs, or the last one is not a head.
    """
    order: list[str] = []
    handles = []
    for name, module in network.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            hook = lambda *_, name=name: order.append(name)  # noqa: E731
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            network(x)
    finally:
        for handle in handles:
            handle.remove()
    if not order:
        raise HeadError(
            f"no module with parameters runs in the forward pass of {type(network).__name__}: "
            "there is no last layer to put a Laplace approximation on"
        )
    name = order[-1]
    check_head(network.get_submodule(name), name)
    return name


@dataclass
class HeadBatch:
    """One batch seen through the head.

    Shape legend: ``N`` samples, ``C`` logit channels, ``D`` head inputs per position,
    ``D̃ = D + 1`` with a bias, ``P`` positions per sample.

    Attributes:
        features: ``φ̃ [N, D̃, P]``: per-position head inputs (im2col patches for
            convolutions), with a last row of ones when the head has a bias.
        logits: The network's output ``f``, ``[N, C, *]`` (plain tensor).
        inputs: The head's input as called (for the Kronecker factors of a transposed
            convolution), ``[N, C_in, *spatial_in]`` or ``[N, *, D]``.
        classes: ``C``.
        has_bias: Whether the head has a bias (the last feature row is then 1).
    """

    features: Tensor
    logits: Tensor
    inputs: Tensor
    classes: int
    has_bias: bool

    @property
    def canonical_logits(self) -> Tensor:
        """``f`` as ``[N, C, P]``."""
        return self.logits.reshape(self.logits.shape[0], self.classes, -1)


def _basis_features(head: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """``φ [N, D, *spatial_out]``: the head's call replayed with an identity basis weight.

    A convolution with weight ``E [D, C_in, *k]``, ``E[j] = e_j`` reshaped, returns its input
    patches, channel ``j = c_in·∏k + k_flat`` (``W.reshape(C, D)``'s column order). A transposed
    convolution with weight ``E [C_in, D, *k]``, ``E[c_in, c_in·∏k + k_flat, k] = 1``, returns
    ``Σ_t x[c_in, t]`` over the input positions ``t`` that reach each output position through
    tap ``k``: the features of ``W.transpose(0, 1).reshape(C, D)``.
    """
    weight = head.weight
    c_in = weight.shape[1] if isinstance(head, CONV_HEADS) else weight.shape[0]
    taps = math.prod(weight.shape[2:])
    D = c_in * taps
    eye = torch.eye(D, dtype=weight.dtype, device=weight.device)
    if isinstance(head, CONV_HEADS):
        basis = eye.reshape(D, c_in, *weight.shape[2:])
    else:
        basis = eye.reshape(c_in, taps, D).transpose(1, 2).reshape(c_in, D, *weight.shape[2:])
    params = {"weight": basis}
    if head.bias is not None:
        params["bias"] = torch.zeros(D, dtype=weight.dtype, device=weight.device)
    return functional_call(head, params, args, kwargs)


def _canonical_weight(head: nn.Module) -> Tensor:
    """The head's weight as ``[C, D]`` in the column order of its features."""
    weight = head.weight
    if isinstance(head, TRANSPOSED_HEADS):
        weight = weight.transpose(0, 1)
    return weight.reshape(weight.shape[0], -1)


def head_permutation(head: nn.Module) -> Tensor:
    """Where each canonical parameter sits in ``parameters_to_vector(head.parameters())``.

    Canonical order: ``θ[c, d]`` for ``d < D`` the weight of output channel ``c`` on feature
    ``d``, ``θ[c, D]`` its bias (if any), flattened row by row (``C·D̃`` entries). Returns
    ``perm [C·D̃]`` with ``vector[perm] = θ.flatten()``.
    """
    offsets, start = {}, 0
    for name, p in head.named_parameters():
        offsets[name] = start
        start += p.numel()
    weight = head.weight
    idx = torch.arange(weight.numel(), device=weight.device).reshape(weight.shape)
    if isinstance(head, TRANSPOSED_HEADS):
        idx = idx.transpose(0, 1)
    idx = idx.reshape(idx.shape[0], -1) + offsets["weight"]
    if head.bias is not None:
        bias = torch.arange(head.bias.numel(), device=weight.device) + offsets["bias"]
        idx = torch.cat([idx, bias.unsqueeze(1)], dim=1)
    return idx.reshape(-1)


def _check_layout(f: Tensor, h_canonical: Tensor, head: nn.Module, name: str, h: Tensor) -> None:
    """The network's output must be the head's output, classes on dim 1 (module docs)."""
    N, C = h_canonical.shape[:2]
    where = _describe(head, name)
    if f.dim() < 2 or f.shape[0] != N or f.numel() != h_canonical.numel() or f.shape[1] != C:
        if isinstance(head, nn.Linear) and h.dim() > 2 and tuple(f.shape) == tuple(h.shape):
            raise HeadError(
                f"the head {where} returns its {C} classes on the last axis, "
                f"{tuple(h.shape)}, and the network returns them as they are; lsn_ext's losses "
                "and predictives take classes on dim 1: return logits.movedim(-1, 1) (reshaped "
                "to the image, e.g. [N, C, H, W]) from the network"
            )
        raise HeadError(
            f"the network's output {tuple(f.shape)} is not the output of its last layer {where}, "
            f"{tuple(h.shape)}: a last-layer Laplace approximation needs the head to produce the "
            "logits [N, C, *] (nothing but a reshape after it). Name the head with "
            "last_layer_name='...', or use subset_of_weights='all'"
        )
    if not torch.equal(f.reshape(N, C, -1), h_canonical):
        raise HeadError(
            f"the network's output {tuple(f.shape)} differs from the output of its last layer "
            f"{where}: something after the head changes the logits (an activation, a "
            "residual sum, a permutation). A last-layer Laplace approximation needs the head's "
            "output to be the logits; name the right head with last_layer_name='...', or use "
            "subset_of_weights='all'"
        )


def _check_linear(features: Tensor, h_canonical: Tensor, head: nn.Module, name: str) -> None:
    """``W φ + b`` must reproduce the head's output (a subclass may compute something else)."""
    weight = _canonical_weight(head).detach()
    phi = features[:, : weight.shape[1]]
    rebuilt = torch.einsum("cd,ndp->ncp", weight, phi)
    scale = torch.einsum("cd,ndp->ncp", weight.abs(), phi.abs())
    if head.bias is not None:
        bias = head.bias.detach().reshape(1, -1, 1)
        rebuilt, scale = rebuilt + bias, scale + bias.abs()
    tol = math.sqrt(torch.finfo(features.dtype).eps)
    if features.is_cuda and features.dtype != torch.float64:
        tol = max(tol, 1e-2)  # cuDNN may run float32 convolutions in TF32 (10-bit mantissa)
    err = (rebuilt - h_canonical).abs() - tol * (scale + torch.finfo(features.dtype).tiny)
    if bool((err > 0).any()):
        raise HeadError(
            f"the head {_describe(head, name)} does not compute W·φ + b from its input as a "
            f"plain {next(t for t in HEAD_TYPES if isinstance(head, t)).__name__} would "
            "(largest deviation "
            f"{float((rebuilt - h_canonical).abs().max()):.3g}): a subclass with its own "
            "forward (weight standardisation, a learned scale) is not linear in its weight. "
            "Name a plain head with last_layer_name='...', or use subset_of_weights='all'"
        )


def capture_head(network: nn.Module, head: nn.Module, x: Any, name: str = "head") -> HeadBatch:
    """Run ``network(x)`` once and see the batch through ``head`` (module documentation).

    Args:
        network: The network (in the mode it should run in: eval for the Laplace).
        head: Its head, a module of ``network`` (:func:`check_head`).
        x: The network's input.
        name: The head's name, for messages.

    Returns:
        The :class:`HeadBatch`.

    Raises:
        HeadError: If the head does not run exactly once, the network's output is not the
            head's output with classes on dim 1, or the head is not linear in its weight.
        TypeError: If the network's output or the head's input is not a tensor.
    """
    check_head(head, name)
    calls: list[tuple[tuple, dict, Any]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        calls.append((args, kwargs, out))

    handle = head.register_forward_hook(hook, with_kwargs=True)
    try:
        f = network(x)
    finally:
        handle.remove()
    if len(calls) != 1:
        raise HeadError(
            f"the head {_describe(head, name)} runs {len(calls)} times in one forward pass; a "
            "last-layer Laplace approximation needs it to run once (it would miss the other "
            "calls' curvature). Name a head that runs once with last_layer_name='...'"
        )
    if not isinstance(f, Tensor):
        raise TypeError(
            f"the network returns a {type(f).__name__}; last-layer Laplace needs one logit "
            "tensor [N, C, *] (wrap it in lsn_ext.SelectOutput to pick one)"
        )
    args, kwargs, h = calls[0]
    inputs = plain_tensor(args[0]) if args else None
    if not isinstance(inputs, Tensor) or inputs.dim() < 2:
        raise TypeError(
            f"the head {_describe(head, name)} was called without a batched input tensor"
        )
    f, h = plain_tensor(f), plain_tensor(h)
    N = inputs.shape[0]
    if isinstance(head, nn.Linear):
        C = head.out_features
        phi = inputs.reshape(N, -1, head.in_features).transpose(1, 2)
        h_canonical = h.reshape(N, -1, C).transpose(1, 2)
    else:
        C = head.weight.shape[0 if isinstance(head, CONV_HEADS) else 1]
        args = (inputs, *args[1:])
        phi = plain_tensor(_basis_features(head, args, kwargs)).reshape(N, -1, h[0, 0].numel())
        h_canonical = h.reshape(N, C, -1)
    _check_layout(f, h_canonical, head, name, h)
    features = phi.detach()
    if head.bias is not None:
        ones = torch.ones_like(features[:, :1])
        features = torch.cat([features, ones], dim=1)
    _check_linear(features, h_canonical.detach(), head, name)
    return HeadBatch(features, f.detach(), inputs.detach(), C, head.bias is not None)


class HeadFeatureExtractor(FeatureExtractor):
    """laplace-torch's ``FeatureExtractor`` whose last layer may be any head of :data:`HEAD_TYPES`.

    laplace-torch 0.3's ``set_last_layer`` raises ``ValueError("Use model with a linear last
    layer.")`` for anything but ``nn.Linear``. Here the head is found by :func:`find_head` (or
    named) and validated by :func:`capture_head` on the first batch: a ``Linear``, ``Conv1–3d``
    or ``ConvTranspose1–3d`` layer (``groups=1``, all parameters trainable) whose output is the
    network's output. ``forward_with_features`` returns the head's raw input, as laplace-torch's
    does; the last-layer curvature and predictives use :func:`capture_head` instead.

    Args:
        model: The network (laplace-torch passes a deep copy of the user's model).
        last_layer_name: The head's name in ``model.named_modules()``; ``None``: found on the
            first forward pass.
        enable_backprop: As laplace-torch's.
        feature_reduction: Must be ``None``: the head's output must be the logits.

    Attributes:
        output_shape: The per-sample shape of the last output (``None`` before a forward).
    """

    def __init__(
        self,
        model: nn.Module,
        last_layer_name: str | None = None,
        enable_backprop: bool = False,
        feature_reduction: Any = None,
    ) -> None:
        if feature_reduction is not None:
            raise ValueError(
                f"feature_reduction={feature_reduction!r} is not supported for convolution or "
                "token heads: the head's output must be the logits [N, C, *]"
            )
        super().__init__(model, None, enable_backprop, None)
        self.output_shape: tuple[int, ...] | None = None
        if last_layer_name is not None:
            self.set_last_layer(last_layer_name)

    def set_last_layer(self, last_layer_name: str) -> None:
        """Make the module ``last_layer_name`` the head (checked by :func:`check_head`).

        Args:
            last_layer_name: The head's name in ``model.named_modules()``.

        Raises:
            HeadError: For a name that is not a module of the network, or a module that cannot
                be a head.
        """
        modules = dict(self.model.named_modules())
        if last_layer_name not in modules:
            candidates = [n for n, m in modules.items() if isinstance(m, HEAD_TYPES)]
            raise HeadError(
                f"the network has no module named {last_layer_name!r}; its {_NAMES} layers are "
                f"{candidates[-5:]} (the last five): pass one of them as last_layer_name"
            )
        module = modules[last_layer_name]
        check_head(module, last_layer_name)
        self._last_layer_name = last_layer_name
        self._modules.pop("last_layer", None)
        object.__setattr__(self, "last_layer", module)
        module.register_forward_hook(self._get_hook(last_layer_name))

    def find_last_layer(self, x: Any) -> Tensor:
        """Find the head with a forward pass (:func:`find_head`), validate it, return the logits.

        Args:
            x: A batch of inputs the network takes, e.g. ``[N, C, *spatial]``.

        Returns:
            The network's logits on ``x``, e.g. ``[N, K, *spatial]``.

        Raises:
            ValueError: If the head is already known.
            HeadError: If the network has no head a last-layer Laplace can use.
        """
        if self.last_layer is not None:
            raise ValueError("Last layer is already known.")
        name = find_head(self.model, x)
        with torch.no_grad():  # validated before its hook is registered
            batch = capture_head(self.model, self.model.get_submodule(name), x, name)
        self.set_last_layer(name)
        self._features[name] = batch.inputs
        self.output_shape = tuple(batch.logits.shape[1:])
        return batch.logits

    def forward(self, x: Any) -> Tensor:
        """The network's output (finding the head on the first call); records its shape.

        Args:
            x: A batch of inputs the network takes.

        Returns:
            The network's output (the head's logits), e.g. ``[N, K, *spatial]``.

        Raises:
            HeadError: On the first call, if the network has no head a last-layer Laplace can
                use.
        """
        out = super().forward(x)
        if isinstance(out, Tensor):
            self.output_shape = tuple(out.shape[1:])
        return out
