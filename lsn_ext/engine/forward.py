r"""The forward counterpart of diagonal backprop: a one-pass linearised predictive variance.

Under a diagonal Gaussian posterior over the parameters, ``θ ~ N(θ_MAP, diag(σ²_θ))`` (e.g. a
diagonal Laplace approximation), the linearised (GLM) predictive variance of output ``o`` is

.. math::

    \operatorname{Var} f_o = \sum_θ J_{oθ}^2 \, σ^2_θ, \qquad J = ∂f/∂θ \text{ at } θ_{MAP}.

Computed exactly this needs one backward pass per output entry (``N·C·H·W`` of them). Its forward
counterpart of DB propagates a *variance vector* ``v`` through the network with squared
Jacobians, taking the diagonal after every layer (the covariances between activations are
dropped):

.. math::

    v_{out} = (J_x \circ J_x)\, v_{in} + \sum_θ (J_θ \circ J_θ)\, σ^2_θ,

starting from ``v = 0`` at the input. One forward pass gives every output's variance. The step is
exact for a single layer, so the result is exact for a one-layer network, for the contribution of
the last parametric layer's own parameters, and whenever only elementwise layers follow the
parameters with non-zero variance; elsewhere it is an approximation (see
``integration/benchmarks/bench_linearized.py`` for how it compares to the exact value and to
sampling).

Mechanism: PyTorch forward-mode AD. The parameters become dual tensors whose tangent is their
variance; the native engine's session runs every layer with a rule as a custom autograd function
whose ``jvp`` applies the rule's :meth:`~lsn_ext.rules.base.Rule.forward_rule`, and constant
scaling as ``c² · v``. Layers and operations with 0/1 Jacobians (ReLU, max pooling, concatenation,
slicing, padding, addition, nearest upsampling) keep their ordinary JVP, which already is the
squared step (``(J ∘ J) v = J v``). So the same models are supported, with the same refusals and
error messages, as by :func:`lsn_ext.diag_backprop`.

Shape legend: ``N`` batch, ``C`` output channels (classes), ``*`` spatial dimensions, ``P``
number of parameters with ``requires_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from lsn_ext._functional import functional_call_all
from lsn_ext.engine.checks import check_finite_logits, check_inputs
from lsn_ext.engine.session import Session

__all__ = ["linearized_variance"]


def linearized_variance(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    param_variance: Tensor | Mapping[str, Tensor],
    *,
    output_fn: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Linearised predictive variance of the logits, in one forward pass.

    Computes ``v_out = (J_x ∘ J_x) v_in + Σ_θ (J_θ ∘ J_θ) σ²_θ`` layer by layer (the diagonal is
    taken after every layer, as in DB), an approximation of ``Var f_o = Σ_θ J_oθ² σ²_θ`` that is
    exact for a single layer and for the last parametric layer's own contribution. Cost: about
    one training step (measured 1.4× forward + backward, 3× a no-grad forward: the LSN paper's
    U-Net, 64², batch 8, CPU), and the memory of a training forward pass (the backward graph is
    recorded, so that the session sees which tensors carry variance, and freed on return).

    On trained networks the dropped covariances between activations add up coherently and the
    result can underestimate the exact linearised variance by orders of magnitude (the same bias
    as DB's; measured in ``integration/benchmarks/bench_linearized.py``); use it as a fast,
    layer-local approximation, not as a substitute for the exact value.

    Args:
        model: An ``nn.Module`` built from supported modules and structural operations (as for
            :func:`lsn_ext.diag_backprop`), in evaluation mode if it has dropout or batch norm.
        inputs: The model input, or a sequence of inputs passed as ``model(*inputs)``. Inputs
            have no variance.
        param_variance: The parameters' variances ``σ²_θ``: either a flat vector ``[P]`` over
            the parameters with ``requires_grad``, in ``model.parameters()`` order (the layout of
            laplace-torch's ``la.posterior_variance`` for ``subset_of_weights="all"``), or a dict
            parameter name (as in ``model.named_parameters()``) → tensor shaped like the
            parameter; parameters missing from the dict have zero variance.
        output_fn: Applied to the model's output inside the same pass, e.g. to pick the mean
            logits from a tuple output; its operations propagate the variance like those of
            ``forward`` (``torch.sigmoid`` gives the delta-method variance of probabilities).

    Returns:
        ``(mean, variance)``: the logits at the current parameters (detached) and their
        linearised variance, both shaped like the output (``[N, C, *]`` or ``[N, K]``), the
        variance non-negative.

    Raises:
        NotImplementedError: A module without a rule, or an operation in ``forward`` that cannot
            be propagated (non-0/1 Jacobian without a rule); the message names it and where.
        ValueError: A ``param_variance`` of the wrong size, shape, name or sign; a module in a
            mode without a valid rule (dropout or batch norm in training mode).
        TypeError: If the (transformed) output is not a tensor.

    Example:
        >>> from lsn_ext.models import UNet
        >>> net = UNet(1, 1, widths=(4, 8)).eval()
        >>> var = torch.full((sum(p.numel() for p in net.parameters()),), 1e-3)
        >>> mean, v = linearized_variance(net, torch.randn(2, 1, 16, 16), var)
        >>> mean.shape == v.shape == (2, 1, 16, 16), bool((v >= 0).all())
        (True, True)
    """
    variances = _variance_dict(model, param_variance)
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    check_inputs(model, args)
    named = dict(model.named_parameters())

    with fwAD.dual_level():
        # Duals are made outside the session, whose mode would refuse ``_make_dual``. Their
        # primals require grad, so that the session routes every affected layer and operation.
        duals = {
            n: fwAD.make_dual(named[n].detach().requires_grad_(True), v)
            for n, v in variances.items()
        }
        with torch.enable_grad(), Session(model, forward_mode=True):
            out = functional_call_all(model, duals, args)
            if output_fn is not None:
                out = output_fn(out)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"the model{' with output_fn' if output_fn is not None else ''} returned "
                f"{type(out).__name__}; the linearised variance needs a tensor of logits (pass "
                "output_fn to select them)"
            )
        primal, tangent = fwAD.unpack_dual(out)
    mean = primal.detach()
    variance = torch.zeros_like(mean) if tangent is None else tangent.detach()
    del out, primal, tangent, duals
    check_finite_logits(mean)
    if not bool(torch.isfinite(variance).all()):
        raise FloatingPointError(
            f"the linearised variance overflows in {variance.dtype} at "
            f"{int((~torch.isfinite(variance)).sum())} of {variance.numel()} outputs; check the "
            "inputs, weights and param_variance for extreme values, or compute in float64"
        )
    return mean, variance


def _variance_dict(
    model: nn.Module, param_variance: Tensor | Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """``param_variance`` as name → non-negative variance, each shaped like its parameter."""
    named = dict(model.named_parameters())
    if isinstance(param_variance, Tensor):
        trainable = [(n, p) for n, p in named.items() if p.requires_grad]
        total = sum(p.numel() for _, p in trainable)
        if param_variance.dim() != 1 or param_variance.numel() != total:
            raise ValueError(
                f"a flat param_variance must be a vector with one entry per parameter with "
                f"requires_grad ({total} for {type(model).__name__}, in model.parameters() "
                f"order); got shape {tuple(param_variance.shape)}"
            )
        chunks = param_variance.split([p.numel() for _, p in trainable])
        pairs = [(n, c.reshape(p.shape)) for (n, p), c in zip(trainable, chunks, strict=True)]
    elif isinstance(param_variance, Mapping):
        unknown = sorted(set(param_variance) - set(named))
        if unknown:
            raise ValueError(
                f"param_variance names {unknown} are not parameters of {type(model).__name__}; "
                f"its parameters are {list(named)}"
            )
        pairs = []
        for n, v in param_variance.items():
            if not isinstance(v, Tensor) or v.shape != named[n].shape:
                shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"param_variance['{n}'] must be a tensor of the parameter's shape "
                    f"{tuple(named[n].shape)}; got {shape}"
                )
            pairs.append((n, v))
    else:
        raise TypeError(
            "param_variance must be a flat tensor or a dict name -> tensor, got "
            f"{type(param_variance).__name__}"
        )
    out = {}
    for n, v in pairs:
        v = v.detach().to(dtype=named[n].dtype, device=named[n].device)
        if bool((v < 0).any()) or not bool(torch.isfinite(v).all()):
            raise ValueError(f"param_variance of '{n}' has negative or non-finite entries")
        out[n] = v.contiguous()
    return out
