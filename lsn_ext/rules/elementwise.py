"""Rules for elementwise activations ``y = φ(x)``: ``m_in = φ'(x)² · m_out`` (exact).

Forward (linearised variance): ``v_out = φ'(x)² · v_in``, exact for the layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lsn_ext.rules.base import Functional, Rule, total_variance

__all__ = [
    "CELURule",
    "ELURule",
    "ElementwiseRule",
    "GELURule",
    "HardsigmoidRule",
    "HardswishRule",
    "LeakyReLURule",
    "MishRule",
    "PReLURule",
    "ReLURule",
    "SELURule",
    "SiLURule",
    "SigmoidRule",
    "SoftplusRule",
    "TanhRule",
    "scale_forward_rule",
    "scale_rule",
]


class ElementwiseRule(Rule):
    """Exact rule for an elementwise map: ``m_in = φ'(x)² · m_out``, all shapes ``[N, *]``.

    Forward: ``v_out = φ'(x)² · v_in`` (zero for ``v_in = None``). The Jacobian is diagonal, so
    neither direction involves an approximation. Subclasses give ``φ'``.
    """

    def derivative(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """Return ``φ'(x)``, shaped like ``x`` (``y = φ(x)`` is given for cheap formulas).

        The rules follow from it: ``m_in = φ'(x)² ⊙ m_out`` and ``v_out = φ'(x)² ⊙ v_in``,
        exact for the layer.

        Args:
            module: The activation module.
            x: Its input ``[N, *]``.
            y: Its output, shaped like ``x``.

        Returns:
            ``φ'(x)``, shaped like ``x``.
        """
        raise NotImplementedError

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        d = self.derivative(module, x, y)
        return d * d * m_out

    def forward_rule(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        if v_in is None:
            return torch.zeros(y.shape, dtype=y.dtype, device=y.device)
        # φ'(x)² is symmetric (diagonal): the backward formula applied to v is the forward step.
        return self.input_rule(module, x.detach(), y.detach(), v_in)


class TanhRule(ElementwiseRule):
    """``φ'(x) = 1 − y²`` with ``y = tanh(x)``; reads only the output (fused ``tanh_backward``)."""

    functional = (Functional("tanh", nn.Tanh),)

    needs_input, needs_output = False, True

    def derivative(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return 1 - y * y

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        m = torch.ops.aten.tanh_backward(m_out, y)
        return torch.ops.aten.tanh_backward.grad_input(m, y, grad_input=m)  # m is ours


class SigmoidRule(ElementwiseRule):
    """``φ'(x) = y(1 − y)`` with ``y = σ(x)``; reads only the output (``sigmoid_backward``)."""

    functional = (Functional("sigmoid", nn.Sigmoid),)

    needs_input, needs_output = False, True

    def derivative(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return y * (1 - y)

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        m = torch.ops.aten.sigmoid_backward(m_out, y)
        return torch.ops.aten.sigmoid_backward.grad_input(m, y, grad_input=m)  # m is ours


class ReLURule(ElementwiseRule):
    """``φ'(x) = 1[x > 0]``; 0/1, so the ordinary backward pass already is the DB step."""

    autograd_exact = True

    def derivative(self, module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return (x > 0).to(x.dtype)


class LeakyReLURule(ElementwiseRule):
    """``φ'(x) = 1`` for ``x > 0``, else ``negative_slope`` (squared: ``slope²``).

    For ``negative_slope ≥ 0`` (every common configuration) ``y > 0`` exactly when ``x > 0``, so
    the rule reads the output instead of the input: an in-place LeakyReLU (MONAI's and nnU-Net's
    default) then needs no copy of its input, whose storage the output overwrites, and the
    output is the tensor that the next layer keeps anyway. A negative slope makes ``y > 0`` on
    both sides of 0, so the input is read then.
    """

    functional = (
        Functional("leaky_relu", nn.LeakyReLU, (("negative_slope", 0.01), ("inplace", False))),
    )

    def reads_input(self, module: nn.LeakyReLU) -> bool:
        return module.negative_slope < 0

    def reads_output(self, module: nn.LeakyReLU) -> bool:
        return module.negative_slope >= 0

    def derivative(self, module: nn.LeakyReLU, x: Tensor, y: Tensor) -> Tensor:
        if self.reads_output(module):
            return torch.where(y > 0, 1.0, module.negative_slope).to(y.dtype)
        return torch.where(x > 0, 1.0, module.negative_slope).to(x.dtype)

    def input_rule(self, module: nn.LeakyReLU, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """``m`` where the read tensor is positive, else ``slope² · m``.

        One fused ``leaky_relu_backward`` with the slope squared.

        Args:
            module: The ``nn.LeakyReLU``.
            x: Its input ``[N, *]`` (shape only when the output is read instead).
            y: Its output, shaped like ``x``.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``m_in``, shaped like ``x`` (exact).
        """
        t = y if self.reads_output(module) else x
        return torch.ops.aten.leaky_relu_backward(m_out, t, module.negative_slope**2, False)


class PReLURule(ElementwiseRule):
    """Exact rule for ``PReLU``: ``y = x`` for ``x > 0``, else ``a · x``, ``x`` ``[N, C, *]``.

    The slope ``a`` is one number or one per channel (dim 1, ``num_parameters = C``). With
    ``φ'(x) = 1`` for ``x > 0``, else ``a``, and ``x⁻ = x · 1[x < 0]``:

    - input: ``m_in = φ'(x)² · m``;
    - weight ``a``: ``Σ m · (x⁻)²`` over every entry it scales (all entries, or ``[N, *]`` per
      channel), shape ``[num_parameters]``;
    - forward (linearised variance): ``v_out = φ'(x)² · v_in + (x⁻)² · σ²_a``.
    """

    @staticmethod
    def _slope(a: Tensor, x: Tensor) -> Tensor:
        """``a`` (or its variance) broadcastable against ``x``: a scalar, or ``[1, C, 1, …]``."""
        a = a.detach()
        if a.numel() == 1:
            return a.reshape(())
        return a.reshape((1, -1) + (1,) * (x.dim() - 2))

    def derivative(self, module: nn.PReLU, x: Tensor, y: Tensor) -> Tensor:
        return torch.where(
            x > 0, torch.ones((), dtype=x.dtype, device=x.device), self._slope(module.weight, x)
        )

    def param_rule(
        self, module: nn.PReLU, x: Tensor, y: Tensor, m_out: Tensor
    ) -> dict[str, Tensor]:
        d = m_out * x.detach().clamp(max=0).square()
        d = d.sum() if module.weight.numel() == 1 else d.sum([0, *range(2, x.dim())])
        return {"weight": d.reshape(module.weight.shape)}

    def forward_rule(
        self,
        module: nn.PReLU,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        x = x.detach()
        var_a = param_var.get("weight")
        terms: list[Tensor | None] = [None, None]
        if v_in is not None:
            terms[0] = self.input_rule(module, x, y, v_in)
        if var_a is not None:
            terms[1] = x.clamp(max=0).square() * self._slope(var_a, x)
        return total_variance(y, terms)


class ELURule(ElementwiseRule):
    """``φ'(x) = 1`` for ``x > 0``, else ``α e^x``."""

    functional = (Functional("elu", nn.ELU, (("alpha", 1.0), ("inplace", False))),)

    def derivative(self, module: nn.ELU, x: Tensor, y: Tensor) -> Tensor:
        return torch.where(x > 0, torch.ones_like(x), module.alpha * torch.exp(x.clamp(max=0)))


class SiLURule(ElementwiseRule):
    """``φ(x) = x σ(x)``, ``φ'(x) = σ(x)(1 + x(1 − σ(x)))``."""

    functional = (Functional("silu", nn.SiLU, (("inplace", False),)),)

    def derivative(self, module: nn.SiLU, x: Tensor, y: Tensor) -> Tensor:
        s = torch.sigmoid(x)
        return s * (1 + x * (1 - s))


class GELURule(ElementwiseRule):
    """``φ(x) = x Φ(x)``, ``φ'(x) = Φ(x) + x 𝒩(x)``; the ``approximate="tanh"`` form likewise."""

    functional = (Functional("gelu", nn.GELU, (("approximate", "none"),)),)

    def derivative(self, module: nn.GELU, x: Tensor, y: Tensor) -> Tensor:
        if module.approximate == "tanh":
            c = math.sqrt(2 / math.pi)
            t = torch.tanh(c * (x + 0.044715 * x**3))
            return 0.5 * (1 + t) + 0.5 * x * (1 - t.square()) * c * (1 + 3 * 0.044715 * x.square())
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x.square()) / math.sqrt(2 * math.pi)
        return cdf + x * pdf


class SoftplusRule(ElementwiseRule):
    """``φ(x) = log(1 + e^{βx})/β``, ``φ'(x) = σ(βx)``; 1 above ``threshold`` (linear there)."""

    functional = (Functional("softplus", nn.Softplus, (("beta", 1.0), ("threshold", 20.0))),)

    def derivative(self, module: nn.Softplus, x: Tensor, y: Tensor) -> Tensor:
        bx = module.beta * x
        return torch.where(bx > module.threshold, torch.ones_like(x), torch.sigmoid(bx))


class MishRule(ElementwiseRule):
    """``φ(x) = x tanh(softplus(x))``: ``φ'(x) = t + x σ(x)(1 − t²)``, ``t = tanh(softplus(x))``."""

    functional = (Functional("mish", nn.Mish, (("inplace", False),)),)

    def derivative(self, module: nn.Mish, x: Tensor, y: Tensor) -> Tensor:
        t = torch.tanh(nn.functional.softplus(x))
        return t + x * torch.sigmoid(x) * (1 - t * t)


class HardswishRule(ElementwiseRule):
    """``φ(x) = x · relu6(x + 3)/6``: ``φ'(x)`` is 0 below −3, ``(2x + 3)/6`` up to 3, then 1."""

    functional = (Functional("hardswish", nn.Hardswish, (("inplace", False),)),)

    def derivative(self, module: nn.Hardswish, x: Tensor, y: Tensor) -> Tensor:
        inner = (2 * x + 3) / 6
        zero, one = torch.zeros_like(x), torch.ones_like(x)
        return torch.where(x < -3, zero, torch.where(x > 3, one, inner))


class HardsigmoidRule(ElementwiseRule):
    """``φ(x) = relu6(x + 3)/6``: ``φ'(x) = 1/6`` on ``(−3, 3)``, else 0.

    Taken from torch's own ``hardsigmoid_backward`` (its ``1/6`` is rounded to float32 even for
    float64 inputs), so that DB squares exactly the derivative autograd uses.
    """

    functional = (Functional("hardsigmoid", nn.Hardsigmoid, (("inplace", False),)),)

    def derivative(self, module: nn.Hardsigmoid, x: Tensor, y: Tensor) -> Tensor:
        return torch.ops.aten.hardsigmoid_backward(torch.ones_like(x), x)


class SELURule(ElementwiseRule):
    """``φ(x) = λ x`` for ``x > 0``, else ``λ α (e^x − 1)``: ``φ'(x) = λ`` or ``λ α e^x``."""

    functional = (Functional("selu", nn.SELU, (("inplace", False),)),)

    scale, alpha = 1.0507009873554805, 1.6732632423543772

    def derivative(self, module: nn.SELU, x: Tensor, y: Tensor) -> Tensor:
        neg = self.alpha * torch.exp(x.clamp(max=0))
        return self.scale * torch.where(x > 0, torch.ones_like(x), neg)


class CELURule(ElementwiseRule):
    """``φ(x) = x`` for ``x > 0``, else ``α (e^{x/α} − 1)``: ``φ'(x) = 1`` or ``e^{x/α}``.

    (torch's own CELU rounds ``1/α`` to float32 in float64 too: autograd's derivative then
    differs from this one by a relative 1e-7 unless ``1/α`` is exact in float32.)
    """

    functional = (Functional("celu", nn.CELU, (("alpha", 1.0), ("inplace", False))),)

    def derivative(self, module: nn.CELU, x: Tensor, y: Tensor) -> Tensor:
        return torch.where(x > 0, torch.ones_like(x), torch.exp(x.clamp(max=0) / module.alpha))


def scale_rule(m_out: Tensor, c: Tensor | float, input_shape: torch.Size) -> Tensor:
    """Rule for multiplication by a constant, ``y = c · x`` (``c`` broadcast): exact.

    ``J = diag(c)`` (with copies where ``x`` is broadcast), so ``m_in = Σ_broadcast c² · m``.
    Covers scalar and constant-tensor products, division by a constant (``c = 1/d``),
    negation and subtraction (``c = −1``: the sign disappears when squared), and means
    (a sum, which is structural, followed by ``c = 1/n``).

    Args:
        m_out: ``m`` w.r.t. ``y``, shape of ``y``.
        c: The constant, a number or a tensor broadcastable to ``y``.
        input_shape: Shape of ``x`` (broadcast dims are summed out).
    """
    c2 = c * c if isinstance(c, (int, float)) else c.square()
    return (m_out * c2).sum_to_size(input_shape)


def scale_forward_rule(v_in: Tensor, c: Tensor | float, output_shape: torch.Size) -> Tensor:
    """Forward counterpart of :func:`scale_rule` for ``y = c · x``: exact.

    ``J = diag(c)`` (with copies where ``x`` is broadcast), so ``v_out = c² · v_in``, broadcast
    to the output's shape; the sign of a negation or subtraction disappears when squared.

    Args:
        v_in: Variance of ``x``, shape of ``x``.
        c: The constant, a number or a tensor broadcastable with ``x``.
        output_shape: Shape of ``y`` (the broadcast of ``x`` and ``c``).

    Returns:
        ``v_out``, shaped ``output_shape``.
    """
    c2 = c * c if isinstance(c, (int, float)) else c.square()
    v_out = v_in * c2
    return v_out if v_out.shape == output_shape else v_out.expand(output_shape).contiguous()
