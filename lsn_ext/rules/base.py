r"""The contract of a diagonal-backpropagation rule.

Diagonal backpropagation (DB; Miani et al. 2022, LSN paper Eq. 22) propagates a vector ``m``, the
diagonal of the curvature w.r.t. a layer's output, backwards through the network. For one layer
``y = f(x; θ)`` with Jacobians ``J_x = ∂y/∂x`` and ``J_θ = ∂y/∂θ`` a rule computes

.. math::

    m_{in} = \operatorname{diag}(J_x^\top \operatorname{diag}(m_{out}) J_x)
           = (J_x \circ J_x)^\top m_{out},
    \qquad d_θ = (J_θ \circ J_θ)^\top m_{out},

summed over the batch. Each rule is *exact* for its layer given a diagonal ``m_out``; the
approximation of DB is that the diagonal is taken again after every layer. Rules never change the
module, its inputs or ``m_out``.

Shapes: ``x`` is the layer input, ``y`` the output (``[N, *]`` each), ``m_out`` has the shape of
``y``, the returned ``m_in`` the shape of ``x``, and each parameter diagonal the shape of its
parameter.

The forward counterpart (:meth:`Rule.forward_rule`) propagates a *variance* vector ``v`` the other
way, with the same squared Jacobians: for inputs and parameters with independent errors of
variances ``v_in`` and ``σ²_θ``, the layer linearised at ``(x, θ)`` has the output variance

.. math::

    v_{out} = (J_x \circ J_x)\, v_{in} + (J_θ \circ J_θ)\, σ^2_θ,

the diagonal of ``J_x diag(v_in) J_xᵀ + J_θ diag(σ²_θ) J_θᵀ``. For one layer this is its exact
linearised (delta-method) variance; through a network, taking the diagonal after every layer drops
the covariances between activations ("D after every layer", forward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Functional", "PerSampleKernel", "Rule"]

PerSampleKernel = Literal["convolution", "linear", "norm"]
"""The direct per-sample-gradient kernels of the Monte-Carlo estimator
(:mod:`lsn_ext.estimators.per_sample`), each for one family of ``torch.nn`` modules:
``"convolution"`` (``Conv1–3d``, ``ConvTranspose1–3d``: ``aten.convolution_backward`` per sample,
the dims from the weight), ``"linear"`` (``nn.Linear``: ``g_nᵀ x_n``) and ``"norm"`` (batch,
instance, group and layer norm: ``Σ g_n · x̂_n`` and ``Σ g_n``, with ``x̂`` from the rule's
``standardised(module, x)`` and the samples independent where its ``check`` passes)."""


class Functional(NamedTuple):
    """A torch function that computes what a module computes, outside any module.

    ``torch.nn.functional.<name>(input, *args)`` (or ``torch.<name>``, ``Tensor.<name>``) equals
    ``module(**arguments)(input)`` with the same arguments: the native engine runs such a call in
    ``forward`` as a node of the module's rule (``F.tanh(x)`` as ``nn.Tanh()``), and an in-place
    call as the in-place module.

    Attributes:
        name: The function's ``__name__`` as the torch-function mode sees it (``"leaky_relu"``).
        module: The module class; called with the bound ``arguments`` as keywords.
        arguments: The function's arguments after the input, ``(name, default)`` in positional
            order; each name is also the module's constructor argument.
    """

    name: str
    module: type[nn.Module]
    arguments: tuple[tuple[str, Any], ...] = ()


def total_variance(y: Tensor, terms: Sequence[Tensor | None]) -> Tensor:
    """The sum of the ``terms`` that are not ``None``, broadcast to the shape of ``y``.

    Forward rules add one variance term for the input and one per parameter; absent inputs or
    parameters contribute nothing, and no term at all means zero variance.
    """
    out: Tensor | None = None
    for term in terms:
        if term is not None:
            out = term if out is None else out + term
    if out is None:
        return torch.zeros(y.shape, dtype=y.dtype, device=y.device)
    return out if out.shape == y.shape else out.expand(y.shape).contiguous()


class Rule:
    """A diagonal-backprop rule for one module type.

    Subclasses implement :meth:`input_rule` and, for parametric layers, :meth:`param_rule`, and
    the forward counterpart :meth:`forward_rule` (linearised variance).
    Layers that get input and parameter diagonals from one fused kernel (convolutions) override
    :meth:`backward` as well. Layers whose output is linear in the input may implement
    :meth:`input_rule_block`, used by the exact first step of the cross-entropy loss.

    Rules are stateless; one instance serves every module of its type.

    The class attributes are the facts about a module type that the rest of the library needs,
    so that adding a layer is the rule, its line in :data:`lsn_ext.rules.RULES` and its test:

    Attributes:
        autograd_exact: True when every entry of the layer's input Jacobian is 0 or 1 and the
            layer has no parameters, so that squaring changes nothing and the ordinary backward
            pass already is the DB step. Adapters may then leave the layer to autograd.
        needs_input: False when the rule reads only the shape of ``x``, not its values.
        needs_output: True when the rule reads the *values* of ``y``.
        functional: The torch functions that compute what the module computes
            (:class:`Functional`: name, module class, arguments). The native engine runs each
            such call in ``forward`` as a node of this rule, where the form's module class is
            registered with this rule (:func:`lsn_ext.rules.functional_forms`); empty by
            default.
        per_sample_kernel: The Monte-Carlo estimator's direct per-sample-gradient kernel for the
            module's parameters (:data:`PerSampleKernel`), or ``None`` (the default): the
            module is replayed per sample. The kernel serves only modules of a ``torch.nn``
            class itself (never a subclass, whose ``forward`` or the methods it calls may
            compute something else) that belongs to the kernel's family
            (:func:`lsn_ext.estimators.per_sample.direct_kernel`).

    Where a rule does not read a tensor's values, adapters may pass a tensor with its shape and
    dtype only (on the ``meta`` device) and need not keep it alive: that saves memory, and an
    in-place operation after the layer (``nn.ReLU(inplace=True)`` after a convolution) cannot
    invalidate what the rule needs.
    """

    autograd_exact: ClassVar[bool] = False
    needs_input: ClassVar[bool] = True
    needs_output: ClassVar[bool] = False
    functional: ClassVar[tuple[Functional, ...]] = ()
    per_sample_kernel: ClassVar[PerSampleKernel | None] = None

    def check(self, module: nn.Module) -> None:
        """Raise ``ValueError`` if the module's current configuration has no valid rule.

        Called by adapters before every use, also for layers left to autograd (e.g. dropout or
        batch norm in training mode, whose Jacobian depends on a random mask or the batch).

        Args:
            module: The layer.

        Raises:
            ValueError: For a configuration without a valid rule, naming it (this default
                accepts every configuration).
        """

    def input_rule(self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor) -> Tensor:
        """Return ``m_in = (J_x ∘ J_x)^T m_out``, shaped like ``x``.

        Args:
            module: The layer.
            x: Its input ``[N, *]``.
            y: Its output ``[N, *]`` for that input.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``m_in``, shaped like ``x``; exact for the layer given a diagonal ``m_out``.
        """
        raise NotImplementedError

    def param_rule(
        self, module: nn.Module, x: Tensor, y: Tensor, m_out: Tensor
    ) -> dict[str, Tensor]:
        """Return ``{name: (J_θ ∘ J_θ)^T m_out}`` for the module's own parameters.

        Keys are the names of ``module.named_parameters(recurse=False)``; each value has the
        parameter's shape and is summed over the batch. Parameter-free layers return ``{}``.

        Args:
            module: The layer.
            x: Its input ``[N, *]``.
            y: Its output ``[N, *]`` for that input.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.

        Returns:
            ``{name: diagonal}``, each shaped like its parameter (``{}`` by default).
        """
        return {}

    def forward_rule(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        v_in: Tensor | None,
        param_var: Mapping[str, Tensor],
    ) -> Tensor:
        """Return ``v_out = (J_x ∘ J_x) v_in + Σ_θ (J_θ ∘ J_θ) σ²_θ``, shaped like ``y``.

        The forward counterpart of :meth:`backward`: exact for the layer (its linearised variance)
        given independent inputs and parameters.

        Args:
            module: The layer.
            x: Its input ``[N, *]``.
            y: Its output ``[N, *]`` for that input.
            v_in: Variance of ``x``, shaped like ``x``; ``None`` means zero (a fixed input).
            param_var: Variance of the module's own parameters, name (as in
                ``module.named_parameters(recurse=False)``) → tensor shaped like the parameter.
                Missing names have zero variance.

        Returns:
            ``v_out``, shaped like ``y``.

        Raises:
            NotImplementedError: If the rule has no forward counterpart.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no forward_rule for {type(module).__name__}, so the "
            "linearised variance cannot be propagated through it; implement "
            "Rule.forward_rule for it"
        )

    def backward(
        self,
        module: nn.Module,
        x: Tensor,
        y: Tensor,
        m_out: Tensor,
        need_input: bool = True,
        need_params: bool = True,
    ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Both rules at once: ``(m_in or None, {name: diagonal})``.

        Adapters call this; override it when one kernel yields both results.

        Args:
            module: The layer.
            x: Its input ``[N, *]``.
            y: Its output ``[N, *]`` for that input.
            m_out: Diagonal curvature w.r.t. ``y``, shaped like ``y``.
            need_input: Compute ``m_in`` (:meth:`input_rule`); ``False`` returns ``None``.
            need_params: Compute the parameters' diagonals (:meth:`param_rule`).

        Returns:
            ``(m_in, {name: diagonal})``: ``m_in`` shaped like ``x`` or ``None``, each diagonal
            shaped like its parameter.
        """
        m_in = self.input_rule(module, x, y, m_out) if need_input else None
        diags = self.param_rule(module, x, y, m_out) if need_params else {}
        return m_in, diags

    def reads_input(self, module: nn.Module) -> bool:
        """Whether the rule reads the values of ``module``'s input (``needs_input`` by default).

        Adapters keep the input alive only when this is True, and clone it before an in-place
        layer overwrites it. Rules whose answer depends on the configuration override this (and
        :meth:`reads_output`) together.

        Args:
            module: The layer.

        Returns:
            Whether the input's values are read.
        """
        return self.needs_input

    def reads_output(self, module: nn.Module) -> bool:
        """Whether the rule reads the values of ``module``'s output (default: ``needs_output``).

        Args:
            module: The layer.

        Returns:
            Whether the output's values are read.
        """
        return self.needs_output

    def is_autograd_exact(self, module: nn.Module) -> bool:
        """Whether the ordinary backward pass of ``module`` already is its DB step.

        ``autograd_exact`` by default; rules whose answer depends on the configuration (nearest
        vs. interpolating upsampling) override this.

        Args:
            module: The layer.

        Returns:
            Whether adapters may leave the layer to autograd.
        """
        return self.autograd_exact

    @classmethod
    def has_block_rule(cls) -> bool:
        """Whether :meth:`input_rule_block` is implemented.

        Returns:
            ``True`` when the class overrides :meth:`input_rule_block`.
        """
        return cls.input_rule_block is not Rule.input_rule_block

    def input_rule_block(self, module: nn.Module, x: Tensor, y: Tensor, h_block: Tensor) -> Tensor:
        """Return ``diag(J_x^T H J_x)`` for a block-diagonal ``H`` on the output's dim 1.

        ``H`` couples the entries of dim 1 (the classes) at each position and sample and nothing
        else: ``h_block`` has shape ``[N, C, C, *]`` for ``y`` of shape ``[N, C, *]``. Only layers
        that are linear in their input and used as a classification head implement this.

        The result must be ``≥ 0``, and implementations clamp it at 0. Justification: for a
        positive semi-definite block the exact value ``Σ_t aᵀ H a`` is ``≥ 0``. The softmax
        block is built diagonally dominant with non-positive off-diagonal entries
        (:meth:`~lsn_ext.rules.losses.CrossEntropy.hessian_block` uses ``p_c Σ_{l≠c} p_l``, not
        ``p_c(1 − p_c)``, which is 0 when ``p_c`` rounds to 1), so
        ``aᵀ H a = Σ_{c<c'} |H_cc'| (a_c − a_c')² + Σ_c (H_cc − Σ_c' |H_cc'|) a_c²`` is a sum of
        non-negative terms. What can still fall below zero is the round-off of the sums over
        classes and taps, a few ulp of the terms' magnitude, so the clamp changes the result by
        no more than that round-off. (A square-root form, ``Σ_j (aᵀ B_j)²`` with ``B Bᵀ = H``,
        would be exact in sign but cost ``C`` times more.)

        Args:
            module: The layer.
            x: Its input ``[N, *]``.
            y: Its output ``[N, *]`` for that input.
            h_block: The loss Hessian's blocks ``[N, C, C, *]``.

        Returns:
            ``m_in = diag(J_x^T H J_x)``, shaped like ``x`` (exact up to round-off, clamped at 0).

        Raises:
            NotImplementedError: For a rule without a block rule (not a linear head).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no block rule for {type(module).__name__}; the exact "
            "cross-entropy first step needs a Linear or convolution head"
        )
