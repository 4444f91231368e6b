"""The variational posterior over a network's parameters: :class:`VariationalPosterior`.

It wraps a model and a family of :mod:`lsn_ext.vi.families`: the ELBO on a batch (the model run
at each draw by :func:`lsn_ext._functional.functional_call_all`, vectorised over the draws by
``torch.func.vmap`` where the model allows), the training loop :meth:`VariationalPosterior.fit`,
and the interface of a Laplace posterior that :func:`lsn_ext.predict`,
:func:`lsn_ext.linearized_variance` and the Laplace Bridge read (``sample``, ``mean``,
``posterior_variance``, ``model``, ``n_params``, ``link``; the link from :mod:`lsn_ext.links`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.func import vmap

from lsn_ext._functional import functional_call_all, unflatten
from lsn_ext.links import link_of_loss
from lsn_ext.rules.losses import Loss, as_loss
from lsn_ext.vi.families import (
    LOG_2PI,
    Family,
    GaussianMixture,
    SampleMode,
    StructuredGaussian,
    elbo,
)

__all__ = ["VariationalPosterior"]


def _positive_finite(name: str, value: object) -> float:
    """``float(value)`` for a finite positive real number; otherwise a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        else:
            raise TypeError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_batch(x: object, y: object) -> None:
    """Refuse non-tensor, empty or non-finite batches (they would turn the ELBO into NaN)."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, Tensor):
            raise TypeError(f"batches must be (x, y) tensors; {name} is a {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty batch [B, ...], got {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} holds NaN or infinite values; clean or mask "
                "them before fitting"
            )


class VariationalPosterior:
    """A variational posterior over the trainable parameters of ``model``.

    ``θ`` is the concatenation of the parameters with ``requires_grad``, in
    ``model.parameters()`` order (laplace-torch's layout). The model is evaluated at a draw by
    ``torch.func.functional_call``; its own parameters are never modified.

    Objective (:meth:`elbo`, maximised):
    ``(N/B) Σ_{batch} log p(y | x, θ) + log p(θ) − log q(θ)`` averaged over the draws, with
    ``log p(y | x, θ) = −loss`` (``reduction="sum"``; e.g. ``MSE(factor=1/(2σ²))`` is a
    Gaussian of standard deviation ``σ``, up to a constant), ``N`` the training-set size and
    ``B = x.shape[0]`` the batch size, and the prior ``p(θ) = N(0, λ⁻¹ I)``.

    The model runs in its current mode (e.g. training-mode dropout adds its noise to the
    likelihood, training-mode batch norm normalises with the batch's statistics), but always
    with copies of its buffers: running statistics are never updated.

    Attributes:
        model: The wrapped network.
        q: The family (:class:`StructuredGaussian` or :class:`GaussianMixture`), an ``nn.Module``
            whose parameters are the variational parameters.
        n_params: ``P``.
        link: ``"sigmoid"`` (BCE), ``"softmax"`` (CE) or ``"identity"`` (MSE), for
            :func:`lsn_ext.predict`.
        loss_fn: The likelihood's loss.
        prior_precision: ``λ``.
        history: ELBO values recorded by :meth:`fit`.

    Args:
        model: Any ``nn.Module``; the initial mean is its current weights.
        likelihood: ``"ce"``, ``"bce"``, ``"mse"``, a :class:`~lsn_ext.Loss` or a torch loss
            module, with ``reduction="sum"``.
        rank: Rank ``r`` of ``U`` (0: mean-field).
        n_components: ``K``; more than one gives a :class:`GaussianMixture`.
        prior_precision: ``λ > 0``.
        init_std: Initial ``√a``.
        min_variance: Floor of ``a``.
        generator: Random generator of the initialisation.

    Raises:
        ValueError: For a model without trainable parameters (or non-finite ones), a loss with
            ``reduction="mean"``, a prior precision or ``init_std`` that is not finite and
            positive, or bad ``rank``/``n_components``.
        TypeError: For a loss without a known link (:class:`lsn_ext.links.NoLinkError`, also a
            ``ValueError``), or a non-numeric prior precision.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Loss | nn.Module = "ce",
        *,
        rank: int = 0,
        n_components: int = 1,
        prior_precision: float = 1.0,
        init_std: float = 1e-3,
        min_variance: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        self.model = model
        self.loss_fn = as_loss(likelihood)
        if self.loss_fn.reduction != "sum":
            raise ValueError("give the likelihood's loss with reduction='sum'")
        self.link = link_of_loss(self.loss_fn)
        self.prior_precision = _positive_finite("prior_precision", prior_precision)
        _positive_finite("init_std", init_std)
        named = self._named()
        if not named:
            raise ValueError(f"{type(model).__name__} has no parameters with requires_grad")
        loc = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.n_params = loc.numel()
        kw = {"init_std": init_std, "min_variance": min_variance, "generator": generator}
        self.q: Family = (
            StructuredGaussian(loc, rank, **kw)
            if n_components == 1
            else GaussianMixture(loc, n_components, rank, **kw)
        )
        self.history: list[float] = []
        self._vectorize = True  # vmap the data term over draws until it proves impossible

    def _named(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    # -- the Laplace-posterior interface --------------------------------------------------------

    def parameters(self) -> Iterable[nn.Parameter]:
        """The variational parameters (pass them to any ``torch.optim`` optimizer).

        Returns:
            The parameters of :attr:`q` (mean, diagonal, factor, mixture logits), not the
            model's.
        """
        return self.q.parameters()

    @property
    def mean(self) -> Tensor:
        """Posterior mean ``E_q θ``, ``[P]`` (detached)."""
        return self.q.mean.detach()

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal variances ``diag(a) + rowsum(U²)`` (mixtures: of the mixture), ``[P]``."""
        return self.q.variance.detach()

    def sample(
        self, n: int, generator: torch.Generator | None = None, mode: SampleMode = "single"
    ) -> Tensor:
        """``n`` draws of ``θ`` from ``q``, without gradient, for predictives and Monte Carlo.

        ``θ = μ + √a ⊙ ε + U z`` with standard normal ``ε``, ``z`` (for a mixture: component
        counts from ``Multinomial(n, π)``, then draws per component); see
        :meth:`StructuredGaussian.rsample`. This is the ``sample`` of laplace-torch's
        posteriors, so :func:`lsn_ext.predict` reads it.

        Args:
            n: Number of draws; a multiple of 2 for ``"paired"``, of ``2r`` for
                ``"unscented"``.
            generator: Random generator.
            mode: ``"single"`` (independent), ``"paired"`` (antithetic ``±``) or
                ``"unscented"`` (see :mod:`lsn_ext.vi`).

        Returns:
            ``[n, P]`` parameter vectors in the layout of the model's trainable parameters.

        Raises:
            ValueError: For an unknown mode, an ``n`` that does not fill whole groups, or more
                draws than the device's memory holds.
        """
        return self.q.sample(n, generator=generator, mode=mode)

    def log_q(self, theta: Tensor) -> Tensor:
        """The variational log-density ``log q(θ)``, exact (:meth:`StructuredGaussian.log_prob`).

        Args:
            theta: Parameter vectors, ``[*, P]``.

        Returns:
            ``[*]`` log-densities, differentiable in the variational parameters.
        """
        return self.q.log_prob(theta)

    def entropy(self, n_samples: int = 256, generator: torch.Generator | None = None) -> Tensor:
        """The entropy ``H[q]``: closed form for a Gaussian, a stratified MC estimate for a mixture.

        Args:
            n_samples: Draws per mixture component (ignored for a single Gaussian).
            generator: Random generator of the mixture's draws.

        Returns:
            The scalar entropy in nats (differentiable).
        """
        if isinstance(self.q, GaussianMixture):
            return self.q.entropy(n_samples, generator)
        return self.q.entropy()

    # -- the objective --------------------------------------------------------------------------

    def _params(self, theta: Tensor) -> dict[str, Tensor]:
        named = self._named()
        sizes = [p.numel() for _, p in named]
        if sum(sizes) != self.n_params:
            raise ValueError(
                "the model's trainable parameters changed since the posterior was built"
            )
        return unflatten(named, theta)

    def log_likelihood(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """``log p(y | x, θ) = −loss(f_θ(x), y)`` (summed over the batch), for one ``θ``.

        Args:
            theta: One parameter vector, ``[P]``.
            x: Inputs ``[B, *]``.
            y: Targets, as the loss expects.

        Returns:
            The scalar log-likelihood (up to the likelihood's normalising constant),
            differentiable in ``θ``.

        Raises:
            ValueError: If the model's trainable parameters changed since the posterior was
                built.
        """
        tensors = self._params(theta)
        # Copies of the buffers: a training-mode batch norm updates the copies, not the model.
        tensors.update({n: b.clone() for n, b in self.model.named_buffers()})
        f = functional_call_all(self.model, tensors, (x,))
        return -self.loss_fn.value(f, y)

    def batched_log_likelihood(
        self, thetas: Tensor, x: Tensor, y: Tensor, *, vectorize: bool | None = None
    ) -> Tensor:
        """``log p(y | x, θ_s)`` for every row of ``thetas`` ``[S, P]``, returns ``[S]``.

        Vectorised over the draws by ``torch.func.vmap`` of :meth:`log_likelihood` (one
        batched forward pass instead of ``S``). Models that ``vmap`` cannot run (in-place
        updates of buffers, e.g. ``BatchNorm`` in training mode; random ops such as ``Dropout``
        in training mode; data-dependent control flow) fall back to a loop over the draws.

        Args:
            thetas: Draws ``[S, P]``.
            x: Inputs ``[B, *]``.
            y: Targets.
            vectorize: ``True`` forces ``vmap`` (errors propagate), ``False`` the loop, ``None``
                (default) tries ``vmap`` and, should it fail where the loop works, uses the
                loop from then on (a batch that fails both ways changes nothing).

        Returns:
            ``[S]`` log-likelihoods, differentiable in ``thetas``.
        """
        use_vmap = self._vectorize if vectorize is None else vectorize
        if use_vmap:
            try:
                return vmap(lambda t: self.log_likelihood(t, x, y))(thetas)
            except (RuntimeError, NotImplementedError, ValueError):
                if vectorize:
                    raise
            # The loop raises what is wrong with the batch itself (bad targets, say); only when
            # it works is the model not vmap-able, and the loop used from then on.
            result = torch.stack([self.log_likelihood(t, x, y) for t in thetas])
            self._vectorize = False
            return result
        return torch.stack([self.log_likelihood(t, x, y) for t in thetas])

    def log_prior(self, theta: Tensor) -> Tensor:
        """``log N(θ; 0, λ⁻¹ I) = −½ λ ‖θ‖² + ½ P (log λ − log 2π)``.

        Args:
            theta: Parameter vectors, ``[*, P]``.

        Returns:
            ``[*]`` log prior densities.
        """
        lam = self.prior_precision
        return -0.5 * lam * theta.pow(2).sum(-1) + 0.5 * self.n_params * (math.log(lam) - LOG_2PI)

    def elbo(
        self,
        x: Tensor,
        y: Tensor,
        n_data: int | None = None,
        n_samples: int = 2,
        mode: SampleMode = "paired",
        *,
        generator: torch.Generator | None = None,
        vectorize: bool | None = None,
    ) -> Tensor:
        """Monte Carlo ELBO on a batch, differentiable in the variational parameters.

        Args:
            x: Inputs ``[B, *]``.
            y: Targets, as the loss expects.
            n_data: Training-set size ``N`` (default: ``B``, i.e. full batch); the data term is
                scaled by ``N/B``.
            n_samples: Draws (per component), a multiple of the mode's group size.
            mode: ``"single"``, ``"paired"`` or ``"unscented"``.
            generator: Random generator.
            vectorize: How the data term is evaluated over the draws: ``None`` (default)
                ``vmap`` with a fallback to a loop, ``True`` ``vmap`` only, ``False`` the loop
                (see :meth:`batched_log_likelihood`).

        Returns:
            The scalar estimate (up to the likelihood's normalising constant).

        Raises:
            ValueError: For an empty or non-finite batch, or ``n_data`` that is not a positive
                int.
        """
        _check_batch(x, y)
        scale = 1.0 if n_data is None else _positive_int("n_data", n_data) / x.shape[0]

        def log_joint(thetas: Tensor) -> Tensor:
            data = self.batched_log_likelihood(thetas, x, y, vectorize=vectorize)
            return scale * data + self.log_prior(thetas)

        return elbo(self.q, log_joint, n_samples, mode, generator=generator)

    def fit(
        self,
        loader: Iterable[tuple[Tensor, Tensor]],
        epochs: int = 1,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float = 1e-2,
        n_samples: int = 2,
        mode: SampleMode = "paired",
        n_data: int | None = None,
        progress: bool | Callable[[int, float], None] = False,
        log_every: int = 50,
        generator: torch.Generator | None = None,
    ) -> VariationalPosterior:
        """Maximise the ELBO over ``epochs`` passes through ``loader``.

        Args:
            loader: Batches ``(x, y)`` (a list of one batch for full-batch training).
            epochs: Passes over the data.
            optimizer: Any optimizer over :meth:`parameters` (default ``Adam(lr=lr)``).
            lr: Learning rate of the default optimizer.
            n_samples: Draws per step (per component).
            mode: Sampling mode.
            n_data: Training-set size (default: the sum of the batch sizes of ``loader``,
                which must then be re-iterable).
            progress: ``True`` prints ``step, ELBO`` every ``log_every`` steps; a callable
                ``(step, elbo)`` is called at every step instead.
            log_every: Printing period for ``progress=True``.
            generator: Random generator of the draws.

        Returns:
            ``self``; the ELBO of every step is appended to :attr:`history`.

        Raises:
            ValueError: For ``epochs``, ``n_samples``, ``n_data`` or ``log_every`` that are not
                positive ints, a learning rate that is not finite and positive, a loader without
                batches, an empty or non-finite batch, or a non-finite ELBO (the variational
                parameters are left as they were before that step).
            RuntimeError: Under ``torch.inference_mode()``, which switches autograd off.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "VariationalPosterior.fit was called under torch.inference_mode(), which switches "
                "autograd off (even inside torch.enable_grad()), so the ELBO has no gradient to "
                "follow; call fit outside the inference_mode block"
            )
        _positive_int("epochs", epochs)
        _positive_int("n_samples", n_samples)
        _positive_int("log_every", log_every)
        if optimizer is None:
            _positive_finite("lr", lr)
        if n_data is None:
            n_data = sum(int(batch[0].shape[0]) for batch in loader)
            if n_data == 0:
                raise ValueError("loader yielded no data: nothing to fit")
        _positive_int("n_data", n_data)
        optimizer = optimizer or torch.optim.Adam(self.parameters(), lr=lr)
        step = len(self.history)
        for _ in range(epochs):
            steps_before = step
            for x, y in loader:
                optimizer.zero_grad()
                value = self.elbo(x, y, n_data, n_samples, mode, generator=generator)
                if not torch.isfinite(value):
                    raise ValueError(
                        f"the ELBO is {float(value)} at step {step}; check the targets and the "
                        "learning rate (the variational parameters were not updated)"
                    )
                (-value).backward()
                optimizer.step()
                value = float(value.detach())
                self.history.append(value)
                if callable(progress):
                    progress(step, value)
                elif progress and step % log_every == 0:
                    print(f"step {step:6d}  ELBO {value:.4g}")
                step += 1
            if step == steps_before:
                raise ValueError("loader yielded no batches: nothing to fit")
        return self
