r"""GGN-diagonal estimators beside plain diagonal backprop: Monte Carlo and calibrated DB.

Diagonal backprop (DB, :func:`~lsn_ext.diag_backprop`) is deterministic and costs one backward
pass, but it is biased: taking the diagonal after every layer drops the cross terms between
neighbouring pixels, and on trained networks these add up coherently, so DB underestimates the
curvature of every layer below the last one or two (see
``integration/benchmarks/bench_accuracy.py``).
:func:`ggn_diagonal` offers three estimators of ``diag Σ_n J_nᵀ H_n J_n`` from one entry point:

``"db"``
    Diagonal backprop: deterministic, one backward pass, biased.
``"mc"``
    Monte Carlo: with ``S`` vectors ``s = B z`` per sample, ``B Bᵀ = H_n``
    (:meth:`~lsn_ext.Loss.hessian_sqrt`) and Rademacher ``z``,

    .. math:: \hat d = \frac{1}{S} \sum_{s=1}^{S} \sum_n (J_n^\top s_n)^{\circ 2},
              \qquad E[\hat d] = \operatorname{diag} \sum_n J_n^\top H_n J_n .

    Unbiased for the exact diagonal, noisy (its variance falls as ``1/S``). Rademacher rather
    than Gaussian ``z`` (or BackPACK's sampled targets) removes the noise of the diagonal terms:
    for a single output the estimate is exact. Cost: one forward pass, ``S`` backward passes and
    one per-sample vector-Jacobian product per parametric layer, linear in the pixels (about 2× a
    training step for ``S = 1``).
``"db_calibrated"``
    DB's shape within each parameter tensor, rescaled so that the tensor's trace equals the
    Monte-Carlo estimate of its trace: ``c_ℓ · d^{DB}_ℓ`` with ``c_ℓ = Σ \hat d_ℓ / Σ d^{DB}_ℓ``.
    The DB traces are deterministic, so every tensor's trace is unbiased, with the Monte-Carlo
    trace's variance (measured on 4 nuclei patches of 32²: relative standard deviation 0.3–0.9
    per tensor for ``S = 1``, 0.12–0.17 for ``S = 16``, falling as ``1/√S`` and with more
    images). The split of the trace between the entries of a tensor is DB's and keeps DB's bias
    (on trained U-Nets the rank correlation within a lower layer's tensor can be anywhere in
    ``[−1, 1]``). With ``shrinkage = λ`` the result is ``(1 − λ) c_ℓ d^{DB}_ℓ + λ \hat d_ℓ``:
    ``λ = 1`` is the Monte-Carlo estimate, values in between trade DB's shape bias for
    Monte-Carlo variance. Cost: DB plus Monte Carlo.

Which to use (``integration/benchmarks/bench_accuracy.py``,
``integration/experiments/lsn_estimators.py``): on trained U-Nets DB keeps 0.03–0.10 of the exact
trace, and 10⁻⁶–10⁻³ of it in the encoder tensors that hold most of it; Monte Carlo is unbiased
(relative error 0.13–0.28 with ``S = 16`` on 4 images, and a Laplace fit sums it over the whole data
set). In the LSN experiment on nuclei patches the uncertainty maps agree across estimators when the
prior precision is tuned on validation NLL, but with the marginal likelihood DB's small curvature
picks a prior 10× too small and the LSN's maps stop localising corruptions, while Monte Carlo's
match the validation-tuned ones. Hence the default ``"mc"`` (``S = 1``).

Per-sample gradients ``J_nᵀ s_n`` are taken per parametric leaf module, from the module's input
``x`` and the gradient ``g`` at its output: ``torch.func.vmap`` over the batch of one
vector-Jacobian product of the module alone (no Python loop over samples, and no per-layer
maths to register: any leaf module whose forward treats the samples independently works).
Where that capture cannot serve a parameter (held by a module with submodules, such as MONAI
UNETR's position embeddings or SwinUNETR's relative-position bias tables; a ``weight_norm`` or
other parametrization; a leaf called on windows folded into dim 0 or on several inputs; a
parameter used outside its module), the smallest enclosing module that is called on the batch
is replayed whole per sample, or else the whole model (``vmap`` over the batch of ``vjp`` of
``functional_call``, the vectors ``s`` as output cotangents, chunked over the batch). The
estimate and its expectation are the same on every path; the result's ``mc_paths`` names the
path per parameter. So Monte Carlo runs on any network whose forward treats the samples
independently.

The package (each module says what it holds): :mod:`~lsn_ext.estimators.api` (the entry
:func:`ggn_diagonal`), :mod:`~lsn_ext.estimators.monte_carlo` (the passes of one Monte-Carlo
call), :mod:`~lsn_ext.estimators.planner` (who serves each parameter, the verified calls and
the caches), :mod:`~lsn_ext.estimators.capture` (the hooks on the owners' calls),
:mod:`~lsn_ext.estimators.replay` (per-sample replay of a leaf, a block or the whole model) and
:mod:`~lsn_ext.estimators.per_sample` (direct per-sample gradient kernels).
"""

from lsn_ext.estimators.api import ESTIMATORS, Estimator, check_estimator, ggn_diagonal

__all__ = ["ESTIMATORS", "Estimator", "check_estimator", "ggn_diagonal"]
