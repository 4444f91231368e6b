"""laplace-torch integration: the ``DiagBackprop`` backend and per-pixel predictives.

``Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag",
backend=DiagBackprop)`` fits a diagonal Laplace approximation whose GGN diagonal comes from
the native engine (:func:`lsn_ext.ggn_diagonal`: Monte Carlo by default, or diagonal
backpropagation), linear in the number of pixels, for models whose logits are
``[N, C, *spatial]`` as well as ``[N, K]``.

Binary segmentation: laplace-torch has no Bernoulli likelihood. Ask for it explicitly through the
backend, ``backend_kwargs={"loss": lsn_ext.BCEWithLogits(pos_weight=...)}`` (or ``"bce"``), with
``likelihood="classification"`` and one logit channel ``[N, 1, *]``. The loss reported to
laplace-torch (and so its log likelihood and marginal likelihood), the curvature and
:func:`predict` (sigmoid link) then all use the same Bernoulli model. laplace-torch's
``state_dict`` does not record the backend's loss: load a BCE posterior into a ``Laplace``
created with the same ``backend_kwargs``. :func:`predict` refuses a softmax over one logit
channel (constant 1), which is what a BCE posterior loaded without its loss would give.

laplace-torch's own predictive (``la(x)``) assumes ``[batch, outputs]`` and a softmax link: the
backend's ``jacobians`` refuses spatial outputs and BCE models with a pointer to :func:`predict`,
so the GLM predictive and laplace-torch's validation grid search fail loudly instead of mixing
pixels and classes or returning 1 everywhere. ``la(x, pred_type="nn")`` does not go through the
backend (it cannot be intercepted) and takes the softmax over the *last* axis; do not use it for
segmentation or BCE models. :func:`predict` and :func:`gridsearch_prior_precision` are the
per-pixel equivalents.

Dense regression: laplace-torch counts only the last output axis in the Gaussian normaliser of
its log likelihood (``n_outputs = W`` for ``[N, C, H, W]``), so the backend refuses regression
outputs with more than two axes; flatten them in the model (``nn.Sequential(net,
nn.Flatten())``, targets ``[N, C·H·W]``) and the normaliser counts every output.

The package's modules, each with one job:

- :mod:`~lsn_ext.laplace_ext.backend`: :class:`DiagBackprop`, what laplace-torch calls, and
  :func:`link_of`, the link of a fitted posterior;
- :mod:`~lsn_ext.laplace_ext.checks`: argument checks (images, batches, models, posteriors);
- :mod:`~lsn_ext.laplace_ext.predictive`: :func:`predict` and :func:`bridge_predictive`;
- :mod:`~lsn_ext.laplace_ext.gridsearch`: :func:`gridsearch_prior_precision`;
- :mod:`~lsn_ext.laplace_ext.head`, :mod:`~lsn_ext.laplace_ext.head_curvature`,
  :mod:`~lsn_ext.laplace_ext.head_posterior`: a network's head (convolution or ``Linear``) as
  the last layer: its features, exact GGN and closed-form per-pixel predictive;
- :mod:`~lsn_ext.laplace_ext.last_layer`: laplace-torch's last-layer classes for convolution
  heads and the per-pixel predictive mixin; :mod:`~lsn_ext.laplace_ext.factory`:
  :func:`Laplace`, laplace-torch's factory with these classes;
- :mod:`~lsn_ext.laplace_ext.digest`: the device-side batch fingerprint that seeds the
  Monte-Carlo vectors.
"""

from lsn_ext.laplace_ext.backend import DiagBackprop, link_of
from lsn_ext.laplace_ext.checks import (
    check_before_laplace_fit,
    check_choice,
    check_eval_norms,
    check_finite,
    check_fitted,
    check_images,
    check_n_samples,
    check_trainable,
    dict_input,
    trainable_params,
)
from lsn_ext.laplace_ext.digest import DIGEST_LCGS, DIGEST_LCGS_CHUNK, batch_digest
from lsn_ext.laplace_ext.factory import LAPLACE_CLASSES, Laplace, register_laplace
from lsn_ext.laplace_ext.gridsearch import GridSearchResult, gridsearch_prior_precision
from lsn_ext.laplace_ext.head import HeadError, HeadFeatureExtractor
from lsn_ext.laplace_ext.head_posterior import head_logit_moments
from lsn_ext.laplace_ext.last_layer import (
    DiagLastLayerLaplace,
    DiagSegmentationLaplace,
    FullLastLayerLaplace,
    KronLastLayerLaplace,
    PerPixelPredictive,
)
from lsn_ext.laplace_ext.predictive import (
    LINK_APPROXES,
    PRED_TYPES,
    NonFinitePredictiveError,
    SegmentationPrediction,
    bridge_predictive,
    glm_logits,
    logit_draws,
    predict,
)
from lsn_ext.links import categorical_entropy

__all__ = [
    "DIGEST_LCGS",
    "DIGEST_LCGS_CHUNK",
    "LAPLACE_CLASSES",
    "LINK_APPROXES",
    "PRED_TYPES",
    "DiagBackprop",
    "DiagLastLayerLaplace",
    "DiagSegmentationLaplace",
    "FullLastLayerLaplace",
    "GridSearchResult",
    "HeadError",
    "HeadFeatureExtractor",
    "KronLastLayerLaplace",
    "Laplace",
    "NonFinitePredictiveError",
    "PerPixelPredictive",
    "SegmentationPrediction",
    "batch_digest",
    "bridge_predictive",
    "categorical_entropy",
    "check_before_laplace_fit",
    "check_choice",
    "check_eval_norms",
    "check_finite",
    "check_fitted",
    "check_images",
    "check_n_samples",
    "check_trainable",
    "dict_input",
    "glm_logits",
    "gridsearch_prior_precision",
    "head_logit_moments",
    "link_of",
    "logit_draws",
    "predict",
    "register_laplace",
    "trainable_params",
]
