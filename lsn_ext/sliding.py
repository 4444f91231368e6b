"""Sliding-window prediction: uncertainty maps of volumes larger than one forward pass allows.

:func:`lsn_ext.predict` with ``window=SlidingWindow(roi_size)`` evaluates every posterior draw
``θ_s`` (or every linearised draw of the GLM predictive) as MONAI's sliding-window inference of
the network: the volume is cut into overlapping windows of ``roi_size``, the network runs on
each, and the window logits are blended into one logit volume ``f̃(x; θ_s) = Σ_i w_i f_i(x; θ_s)``
with MONAI's weights (``"gaussian"`` or ``"constant"``, normalised to sum to 1 at every voxel).

How means and variances combine: the maps are computed from the blended logits of each draw,
exactly as for a network that is the sliding-window procedure. So ``E p`` is the mean over the
draws of ``link(f̃(x; θ_s))``, and ``Var p``, the entropy and the mutual information are those
of the same draws at each voxel. Where windows overlap, the variance therefore includes the
covariance between the windows' predictions under the posterior. Blending per-window variances,
or per-window second moments (a mixture over windows), would not: the first ignores that
covariance and the second adds the spread between windows. Memory is that of one logit volume
per draw plus the running moments; compute is ``n_samples`` sliding-window passes (the GLM: one
forward-mode pass per antithetic pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["SlidingWindow"]

_MODES = ("gaussian", "constant")


@dataclass(frozen=True)
class SlidingWindow:
    """Settings of MONAI's ``sliding_window_inference`` for :func:`lsn_ext.predict`.

    Attributes:
        roi_size: Window size per spatial dimension (one int per spatial axis of the input).
        overlap: Overlap of neighbouring windows as a fraction of the window, in ``[0, 1)``.
        mode: Blending weights of overlapping windows: ``"gaussian"`` or ``"constant"``.
        sw_batch_size: Windows per forward pass.
        sigma_scale: Width of the Gaussian weights relative to the window (MONAI's default).

    Raises:
        ValueError: For a non-positive window size, an overlap outside ``[0, 1)``, an unknown
            mode or a non-positive ``sw_batch_size``.
    """

    roi_size: Sequence[int]
    overlap: float = 0.25
    mode: str = "gaussian"
    sw_batch_size: int = 1
    sigma_scale: float = 0.125

    def __post_init__(self) -> None:
        roi = tuple(self.roi_size)
        if not roi or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in roi):
            raise ValueError(f"roi_size must be positive ints, one per spatial axis; got {roi}")
        object.__setattr__(self, "roi_size", roi)
        if not 0 <= self.overlap < 1:
            raise ValueError(f"overlap must lie in [0, 1), got {self.overlap}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.sw_batch_size < 1:
            raise ValueError(f"sw_batch_size must be positive, got {self.sw_batch_size}")

    def __call__(self, network: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """Blended logits of ``network`` over the windows of ``x``.

        ``f̃(x) = Σ_i w_i f_i(x)``, MONAI's blending weights normalised to sum to 1 at every
        voxel.

        Args:
            network: Maps a batch of windows ``[B, C_in, *roi_size]`` to logits
                ``[B, K, *roi_size]``.
            x: The input volume(s), ``[N, C_in, *spatial]``.

        Returns:
            Logits over the whole input, ``[N, K, *spatial]``.

        Raises:
            ImportError: If MONAI is not installed.
            ValueError: If ``roi_size`` does not have one entry per spatial axis of ``x``.
        """
        try:
            from monai.inferers import sliding_window_inference
        except ImportError as err:
            raise ImportError(
                "lsn_ext.SlidingWindow runs MONAI's sliding_window_inference: pip install monai"
            ) from err
        if len(self.roi_size) != x.dim() - 2:
            raise ValueError(
                f"roi_size {self.roi_size} has {len(self.roi_size)} entries but the input "
                f"{tuple(x.shape)} has {x.dim() - 2} spatial axes"
            )
        return sliding_window_inference(
            x,
            self.roi_size,
            self.sw_batch_size,
            network,
            overlap=self.overlap,
            mode=self.mode,
            sigma_scale=self.sigma_scale,
        )


def as_window(window: object) -> Callable[[Callable[[Tensor], Tensor], Tensor], Tensor] | None:
    """The ``window`` argument of :func:`lsn_ext.predict`, with a window size accepted.

    A tuple or list of ints is the window size (``roi_size``, one int per spatial axis) with the
    default settings: ``window=(96, 96, 96)`` is ``SlidingWindow((96, 96, 96))``. ``None``, a
    :class:`SlidingWindow` and any other ``(network, x) -> logits`` callable pass unchanged.

    Args:
        window: ``None``, a window size, a :class:`SlidingWindow` or a callable.

    Returns:
        ``None`` or a ``(network, x) -> logits`` callable.

    Raises:
        TypeError: For anything else, naming its type and the accepted forms.
        ValueError: For a window size that :class:`SlidingWindow` refuses.
    """
    if window is None or callable(window):
        return window
    if isinstance(window, tuple | list):
        return SlidingWindow(tuple(window))
    raise TypeError(
        "window must be an lsn_ext.SlidingWindow or a window size (a tuple of ints, one per "
        f"spatial axis, e.g. window=(96, 96, 96)); got {type(window).__name__} {window!r}"
    )
