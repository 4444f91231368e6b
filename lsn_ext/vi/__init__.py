"""Structured variational inference over a network's parameters (Le Folgoc et al. 2021).

Variational families over the ``P`` trainable parameters of any ``nn.Module`` (the network is
run with sampled parameters through ``torch.func.functional_call``; it is never rewritten):

* :class:`StructuredGaussian`: ``q(θ) = N(μ, Σ)``, ``Σ = diag(a) + U Uᵀ`` with ``a > 0``
  (``softplus`` of a free parameter) and ``U ∈ ℝ^{P×r}`` shared across all layers, so the
  low-rank part couples parameters within and across layers. ``r = 0`` is mean-field.
* :class:`GaussianMixture`: ``q(θ) = Σ_c π_c N(θ; μ_c, Σ_c)`` with structured components of a
  common rank and weights ``π = softmax(logits)``.

Densities never form a ``P×P`` matrix. With ``D = diag(a)``, the capacitance
``C = I_r + Uᵀ D⁻¹ U`` (``r×r``) and ``d = θ − μ``:

* Woodbury: ``dᵀ Σ⁻¹ d = dᵀ D⁻¹ d − wᵀ C⁻¹ w`` with ``w = Uᵀ D⁻¹ d``;
* matrix-determinant lemma: ``log |Σ| = Σ_i log a_i + log |C|``;
* ``log q(θ) = −½ (P log 2π + log |Σ| + dᵀ Σ⁻¹ d)``, entropy ``½ (P (1 + log 2π) + log |Σ|)``.

Cost per density evaluation ``O(P r + r³)``; per sample ``O(P r)``.

Sampling is reparametrised, ``θ = μ + √a ⊙ ε + U z`` with ``ε ~ N(0, I_P)``, ``z ~ N(0, I_r)``,
in three modes (the paper's §4):

* ``"single"``: independent draws.
* ``"paired"`` (antithetic): draws come in mirrored pairs ``μ ± (√a ⊙ ε + U z)``.
* ``"unscented"``: groups of ``2r`` draws (2 for mean-field): a Haar-random orthogonal
  ``Q ∈ O(r)`` and one radius ``ρ ~ χ_r`` give ``z_j = ρ Q e_j`` for ``j = 1..r`` (orthogonal
  directions in the low-rank subspace, of common length), each with its own ``ε_j``, followed by
  the ``r`` mirrors ``μ − (√a ⊙ ε_j + U z_j)``. Every draw is still exactly ``N(μ, Σ)``
  (``ρ Q e_j ~ N(0, I_r)``), so Monte Carlo estimates stay unbiased, while each group has mean
  exactly ``μ`` and low-rank second moment ``(1/2r) Σ_j z_j z_jᵀ = (ρ²/r) I_r`` (isotropic).

Objective: the ELBO ``E_q[log p(Y | X, θ) + log p(θ) − log q(θ)]`` estimated, as the paper
advocates, with ``log q`` of the drawn samples rather than the closed-form entropy (scaling
effects of a draw then affect all terms alike). Mixtures use stratified sampling,
``Σ_c π_c E_{q_c}[·]``, which is exact and differentiable in ``π``.

:class:`VariationalPosterior` wraps a model: its ``sample``, ``mean``, ``posterior_variance``,
``model``, ``n_params`` and ``link`` are what :func:`lsn_ext.predict`,
:func:`lsn_ext.linearized_variance` and the Laplace Bridge read from a Laplace posterior.

The package, by job:

- :mod:`~lsn_ext.vi.families`: :class:`StructuredGaussian`, :class:`GaussianMixture`,
  :func:`elbo` and :func:`gaussian_kl`;
- :mod:`~lsn_ext.vi.posterior`: :class:`VariationalPosterior` (the ELBO of a network on a batch,
  the training loop, the Laplace-posterior interface).
"""

from lsn_ext.vi.families import Family as Family
from lsn_ext.vi.families import (
    GaussianMixture,
    SampleMode,
    StructuredGaussian,
    elbo,
    gaussian_kl,
)
from lsn_ext.vi.posterior import VariationalPosterior

__all__ = [
    "GaussianMixture",
    "SampleMode",
    "StructuredGaussian",
    "VariationalPosterior",
    "elbo",
    "gaussian_kl",
]
