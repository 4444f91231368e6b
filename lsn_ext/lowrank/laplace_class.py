r"""laplace-torch's ``LowRankLaplace`` without ASDL: :class:`LowRankGGNLaplace`.

laplace-torch 0.3's ``LowRankLaplace`` raises ``ImportError`` in its constructor unless the old
``asdfghjkl`` package is installed, and its only backend (``AsdfghjklHessian``) computes the
Hessian's eigenpairs. :class:`LowRankGGNLaplace` is the same class (laplace-torch's sampler,
marginal likelihood and prior optimisation) with

- no ``asdfghjkl`` check, and the backend's ``eig_lowrank(train_loader, rank=..., ...)`` on the
  whole loader (:meth:`lsn_ext.DiagBackprop.eig_lowrank`: Lanczos on matrix-free GGN-vector
  products, :func:`~lsn_ext.lowrank.lowrank_ggn`);
- a *low-rank plus diagonal* posterior precision (``diagonal="ggn"``, the default)

  .. math::

      P = U Λ U^\top + \operatorname{diag}(p_0 + r), \qquad
      r = \max\bigl(\operatorname{diag}(G) - \operatorname{diag}(U Λ U^\top), 0\bigr),

  with ``diag(G)`` the backend's GGN diagonal (``backend.diag`` summed over the loader;
  :class:`~lsn_ext.DiagBackprop`: unbiased Monte Carlo), so that ``diag P`` is the diagonal
  Laplace's ``p_0 + diag G`` wherever the clamp is inactive; or laplace-torch's
  ``P = U Λ Uᵀ + diag(p_0)`` (``diagonal="prior"``).

Why ``"ggn"`` is the default: with the prior alone, every direction outside the ``k`` eigenvectors
keeps the prior variance ``1/p_0``, which for the ``10⁵–10⁷`` parameters of a segmentation
network makes the predictive variance that of the prior, whatever the data say. With the
remainder the posterior nests lsn_ext's diagonal Laplace (``k = 0`` gives it exactly) and adds
the top-``k`` correlations, so a comparison with the diagonal posterior isolates what the low
rank buys; its marginal variances lie between the diagonal Laplace's and the prior-only low
rank's (``(P⁻¹)_ii ≥ 1/P_ii``). The remainder's Monte-Carlo noise, where ``diag(G) − diag(UΛUᵀ)``
is near zero, is clamped at zero (biased up by at most the noise there).

Posterior maths in :class:`~lsn_ext.lowrank.posterior.LowRankPlusDiagonal` (Woodbury with a
``k×k`` Cholesky factor: log-determinant, marginal variances, ``J Σ Jᵀ``); samples from
laplace-torch's ``LowRankLaplace.sample`` (``D^{-½}(I + W Wᵀ)^{-½} z``), which
:func:`lsn_ext.predict` draws for both predictives.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from lsn_ext._laplace import baselaplace
from lsn_ext.lowrank.curvature import LowRankGGN, check_rank_options
from lsn_ext.lowrank.posterior import LowRankPlusDiagonal

__all__ = ["LowRankGGNLaplace"]

DIAGONALS = ("ggn", "prior")


class LowRankGGNLaplace(baselaplace.LowRankLaplace):
    """Low-rank (plus diagonal) GGN Laplace over all weights, in laplace-torch's API.

    ``LowRankGGNLaplace(model, "classification", backend=DiagBackprop,
    backend_kwargs={"loss": "bce"}, rank=10)``, then ``fit``, ``optimize_prior_precision``,
    ``sample``, ``log_marginal_likelihood``, ``state_dict`` as for any laplace-torch ``Laplace``,
    and :func:`lsn_ext.predict` for per-pixel maps (module documentation for the maths).

    Args:
        model: The network; its trainable parameters get the posterior (all weights).
        likelihood: ``"classification"`` or ``"regression"``, as for laplace-torch.
        backend: A backend class with ``eig_lowrank(train_loader, rank=, energy=, steps=,
            trace_probes=, tol=)`` (and ``diag`` for ``diagonal="ggn"``):
            :class:`lsn_ext.DiagBackprop`.
        rank: Eigenpairs kept (with ``energy``: at most); default 10 (a fit of 58 training
            epochs of CPU time on the paper's U-Net at 64², ``lowrank_cost.md``).
        energy: ``None`` (fixed rank) or the fraction of ``tr G`` the kept eigenvalues must
            capture (:func:`~lsn_ext.lowrank.lowrank_ggn`).
        steps: Lanczos steps (default ``2·rank + 10``).
        trace_probes: Hutchinson probes of ``tr G`` (with ``energy``).
        tol: Residual tolerance of the convergence warning, relative to ``λ_max``.
        diagonal: ``"ggn"`` (default: prior plus the GGN diagonal's remainder) or ``"prior"``
            (laplace-torch's prior-only diagonal).
        sigma_noise: Observation noise ``σ`` of the regression likelihood (as laplace-torch).
        prior_precision: Precision of the isotropic Gaussian prior (scalar or ``[P]``).
        prior_mean: Mean of the prior (scalar or ``[P]``).
        temperature: Posterior temperature ``T``; the GGN is divided by ``σ² T``.
        enable_backprop: Keep the graph through the predictive (as laplace-torch).
        dict_key_x: Key of the inputs in dictionary batches.
        dict_key_y: Key of the targets in dictionary batches.
        backend_kwargs: Keyword arguments of the backend, e.g. ``{"loss": "bce"}``.
        asdl_fisher_kwargs: Passed to laplace-torch (unused by :class:`~lsn_ext.DiagBackprop`).

    Attributes:
        H: ``(U [P, k], λ [k])`` after ``fit`` (laplace-torch's layout).
        diagonal_remainder: ``r`` ``[P]`` (``None`` for ``diagonal="prior"``).
        lowrank_result: The :class:`~lsn_ext.lowrank.LowRankGGN` of the last fit (residuals, steps,
            trace estimate).

    Raises:
        ValueError: For a missing backend or one without ``eig_lowrank``, or bad options.
    """

    # laplace.Laplace() maps the `_key` of every subclass to its class (in a set's order): a
    # key of its own keeps laplace-torch's ("all", "lowrank") on laplace-torch's LowRankLaplace.
    _key = ("all", "lowrank (lsn_ext, GGN-vector products)")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        backend: type | None = None,
        sigma_noise: float | Tensor = 1,
        prior_precision: float | Tensor = 1,
        prior_mean: float | Tensor = 0,
        temperature: float = 1,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        *,
        rank: int = 10,
        energy: float | None = None,
        steps: int | None = None,
        trace_probes: int = 10,
        tol: float = 1e-2,
        diagonal: Literal["ggn", "prior"] = "ggn",
    ):
        if backend is None or not callable(getattr(backend, "eig_lowrank", None)):
            name = getattr(backend, "__name__", repr(backend))
            raise ValueError(
                f"LowRankGGNLaplace needs a backend with eig_lowrank(train_loader, rank=...), "
                f"got {name}: pass backend=lsn_ext.DiagBackprop (Lanczos on GGN-vector "
                "products; its options go in backend_kwargs)"
            )
        check_rank_options(rank, energy, steps, trace_probes, tol)
        if diagonal not in DIAGONALS:
            raise ValueError(f"diagonal must be one of {DIAGONALS}, got {diagonal!r}")
        self.rank, self.energy, self.steps = rank, energy, steps
        self.trace_probes, self.tol, self.diagonal = trace_probes, tol, diagonal
        # LowRankLaplace.__init__ only adds the asdfghjkl check: skip to its base class.
        baselaplace.ParametricLaplace.__init__(
            self,
            model,
            likelihood,
            sigma_noise=sigma_noise,
            prior_precision=prior_precision,
            prior_mean=prior_mean,
            temperature=temperature,
            enable_backprop=enable_backprop,
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
            backend=backend,
            backend_kwargs=backend_kwargs,
            asdl_fisher_kwargs=asdl_fisher_kwargs,
        )

    def _init_H(self) -> None:
        self.H: tuple[Tensor, Tensor] | None = None
        self.diagonal_remainder: Tensor | None = None
        self.lowrank_result: LowRankGGN | None = None

    def _batch(self, data: Any) -> tuple[Any, Tensor]:
        if isinstance(data, MutableMapping):
            return data, data[self.dict_key_y].to(self._device)
        X, y = data
        return X.to(self._device), y.to(self._device)

    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False) -> None:
        """Eigenpairs of the GGN over the whole ``train_loader`` (and the diagonal remainder).

        As laplace-torch's ``fit``: puts the model in eval mode, sets ``mean``, ``n_outputs``
        (``model.output_size``), ``loss`` and ``n_data = len(train_loader.dataset)``.

        Args:
            train_loader: A ``DataLoader`` (with a ``dataset``) of ``(x, y)`` or dictionary
                batches.
            override: Must be ``True``: a low-rank fit replaces the previous one.
            progress_bar: Accepted for laplace-torch's signature and ignored (the Lanczos
                iteration shows no bar).

        Raises:
            ValueError: For ``override=False`` (eigenpairs do not add up over fits), regression
                targets whose dimensions differ from the outputs', or what the backend's
                ``eig_lowrank`` refuses.
        """
        if not override:
            raise ValueError(
                "a low-rank Laplace cannot be updated (eigenpairs do not add up over fits): "
                "refit on all the data with override=True"
            )
        self._init_H()
        self.model.eval()
        self.mean = parameters_to_vector(self.params)
        if not self.enable_backprop:
            self.mean = self.mean.detach()
        X, y = self._batch(next(iter(train_loader)))
        with torch.no_grad():
            out = self.model(X if isinstance(X, MutableMapping) else X[:1])
        if self.likelihood == "regression" and y.ndim != out.ndim:
            raise ValueError(f"The model's output has {out.ndim} dims but the target has {y.ndim}")
        self.n_outputs = out.shape[-1]
        self.model.output_size = self.n_outputs
        N = len(train_loader.dataset)
        result = self.backend.eig_lowrank(
            train_loader,
            rank=self.rank,
            energy=self.energy,
            steps=self.steps,
            trace_probes=self.trace_probes,
            tol=self.tol,
        )
        U, eigenvalues, loss = result
        if self.diagonal == "ggn":
            diag = torch.zeros(self.n_params, device=self._device, dtype=self._dtype)
            for data in train_loader:
                diag += self.backend.diag(*self._batch(data), N=N)[1]
            self.diagonal_remainder = (diag - (U.square() * eigenvalues).sum(1)).clamp_min(0)
        self.H = (U, eigenvalues)
        self.loss = loss
        self.lowrank_result = result if isinstance(result, LowRankGGN) else None
        self.n_data = N

    @property
    def posterior_precision(self) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((U, λ/σ²T), p_0 + r/σ²T)``: laplace-torch's layout, the remainder in the diagonal."""
        self._check_H_init()
        U, eigenvalues = self.H
        d = self.prior_precision_diag
        if self.diagonal_remainder is not None:
            d = d + self._H_factor * self.diagonal_remainder
        return (U, self._H_factor * eigenvalues), d

    @property
    def precision(self) -> LowRankPlusDiagonal:
        """The posterior precision as a :class:`~lsn_ext.lowrank.LowRankPlusDiagonal`."""
        (U, eigenvalues), d = self.posterior_precision
        return LowRankPlusDiagonal(U, eigenvalues, d)

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P`` (Woodbury, a ``k×k`` Cholesky factor; no division by ``λ``)."""
        return self.precision.log_det()

    @property
    def posterior_variance(self) -> Tensor:
        """The marginal posterior variances ``diag Σ``, ``[P]`` (exact for this precision)."""
        return self.precision.variance()

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J Σ Jᵀ`` per input, for laplace-torch's GLM predictive.

        Args:
            Js: Jacobians of the outputs, ``[N, C, P]``.

        Returns:
            ``[N, C, C]``.
        """
        return self.precision.functional_covariance(Js)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """``J Σ Jᵀ`` jointly over all ``N·C`` outputs (laplace-torch's joint predictive).

        Args:
            Js: Jacobians of the outputs, ``[N, C, P]``.

        Returns:
            ``[N·C, N·C]``.
        """
        n, c, p = Js.shape
        return self.precision.functional_covariance(Js.reshape(1, n * c, p))[0]

    def square_norm(self, value: Tensor) -> Tensor:
        """``(θ − mean)ᵀ P (θ − mean)`` with the posterior precision ``P`` (exact).

        Args:
            value: ``θ``, ``[P]`` or ``[n, P]``.

        Returns:
            A scalar, or ``[n]``.
        """
        return self.precision.square_norm(value - self.mean)

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state plus the diagonal remainder and the rank options.

        Returns:
            The state, for ``torch.save`` and :meth:`load_state_dict`.
        """
        state = super().state_dict()
        state["diagonal_remainder"] = self.diagonal_remainder
        state["lowrank_options"] = {
            "rank": self.rank,
            "energy": self.energy,
            "steps": self.steps,
            "trace_probes": self.trace_probes,
            "tol": self.tol,
            "diagonal": self.diagonal,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`.

        Args:
            state_dict: The state, as :meth:`state_dict` returns it.

        Raises:
            ValueError: For another Laplace class (laplace-torch's check), or a state whose
                ``diagonal`` option differs from this object's (the remainder would be
                silently dropped or missing).
        """
        saved = state_dict.get("lowrank_options", {}).get("diagonal")
        if state_dict.get("cls_name") == type(self).__name__ and saved != self.diagonal:
            raise ValueError(
                f"the state was saved with diagonal={saved!r} but this LowRankGGNLaplace has "
                f"diagonal={self.diagonal!r}: create it with diagonal={saved!r}"
            )
        super().load_state_dict(state_dict)
        self.diagonal_remainder = state_dict["diagonal_remainder"]
