"""Data-parallel fits: one posterior from all ranks' shards (``torch.distributed``).

Under ``torchrun`` each rank iterates over its own shard of the training data. When
``torch.distributed`` is initialised with a world size above 1, :class:`lsn_ext.DiagBackprop`
all-reduces (sums) each batch's GGN diagonal and loss inside its ``diag``, so laplace-torch's own
``fit`` leaves the ``H``, ``loss`` and ``n_data`` of a single-process fit over the whole data set
on *every* rank (Monte Carlo: equal in expectation, with independent vectors per rank). Prior
tuning then agrees across ranks too: ``la.optimize_prior_precision(method="marglik")`` depends
only on those, and :func:`lsn_ext.gridsearch_prior_precision` sums its validation NLL over the
ranks. ``backend_kwargs={"distributed": False}`` opts out (each rank keeps its shard's posterior).

Rules for the training loader (checked; a violation raises on every rank at once):

* Every rank makes the same number of ``diag`` calls, i.e. has the same number of batches: the
  all-reduce of a batch waits for every rank. A :class:`torch.utils.data.distributed.
  DistributedSampler` and the same ``batch_size`` on every rank guarantee it. The backend
  follows laplace-torch's ``fit`` (it finds its ``train_loader`` on the call stack) and compares
  the ranks' batch counts on the first batch of every fit; :class:`ShardedLoader` checks them
  when it is built.
* Per fit, the ranks together see each sample exactly once: ``len(train_loader.dataset)``
  (laplace-torch's ``n_data``) must equal the number of samples summed over the ranks, which
  the backend checks on the last batch of every fit (and whenever the count runs past
  ``n_data``). With a ``DistributedSampler`` over the full data set this holds when
  ``len(dataset)`` is divisible by the world size; otherwise ``drop_last=False`` pads the shards
  by repeating samples and ``drop_last=True`` drops up to ``world_size - 1`` samples: both are
  refused on the first batch (:func:`check_loader`).
* Per-rank datasets (e.g. a ``Subset`` per rank) make ``len(train_loader.dataset)`` the shard's
  size: wrap the loader in :class:`ShardedLoader`, which reports the summed size; unwrapped,
  the count runs past ``n_data`` and the fit is refused.
* A batch that one rank cannot fit (a NaN image, say) stops every rank, naming it.

Prediction needs no communication: run :func:`lsn_ext.predict` on each rank's shard of the test
set and gather the maps if one rank needs them all::

    pred = lsn_ext.predict(la, x_shard, n_samples=50)
    maps = [torch.empty_like(pred.mean) for _ in range(dist.get_world_size())]
    dist.all_gather(maps, pred.mean)  # equal shard shapes; else all_gather_object

(``gloo`` gathers CPU tensors, ``nccl`` CUDA tensors.) The posterior samples of ``predict`` are
drawn with the ``generator`` given to it, so pass each rank the same seed for common samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ShardedLoader", "check_loader", "unwrap", "world"]


def world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when ``torch.distributed`` is initialised with more than one rank.

    Returns:
        The rank and world size, or ``None`` for a single process.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def unwrap(model: nn.Module) -> nn.Module:
    """The network inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper, else ``model``.

    The curvature and the predictive run on the underlying module: DDP's forward would install
    its gradient-synchronisation hooks and broadcast buffers on every call, which the per-sample
    replays of the estimators must not trigger. The parameters are the same tensors.

    Args:
        model: A network, possibly wrapped (nested wrappers are unwrapped too).

    Returns:
        The innermost ``module``, or ``model`` itself.
    """
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return model


def collective_device(t: Tensor) -> torch.device:
    """Where a collective on ``t`` must run: NCCL only reduces CUDA tensors."""
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        raise RuntimeError(
            f"rank {dist.get_rank()}: the NCCL process group reduces CUDA tensors, but the "
            f"curvature is on {t.device}; move the model to torch.cuda.current_device() or "
            "initialise the process group with backend='gloo' for a CPU fit"
        )
    return t.device


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum ``t`` over the ranks (in place on a contiguous copy); returns the sum."""
    t = t.contiguous().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_range(values: list[int], device: torch.device) -> list[tuple[int, int]]:
    """``(min, max)`` over the ranks of each integer in ``values`` (one collective)."""
    t = torch.tensor([v for x in values for v in (x, -x)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    flat = t.tolist()
    return [(-flat[2 * i + 1], flat[2 * i]) for i in range(len(values))]


def check_loader(loader: Any) -> None:
    """Refuse a ``DistributedSampler`` that pads or drops samples (no communication).

    With ``len(dataset)`` not divisible by the world size, ``drop_last=False`` repeats samples
    to pad the shards (their curvature would be counted twice) and ``drop_last=True`` leaves
    samples out (their curvature would be missing while laplace-torch's ``n_data`` counts them).

    Args:
        loader: The training ``DataLoader`` (anything else passes unchecked).

    Raises:
        ValueError: For a padding or dropping ``DistributedSampler``, naming the rank, the sizes
            and the fix.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        return
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if n % sampler.num_replicas:
        what = (
            f"drops the last {n % sampler.num_replicas} sample(s) (drop_last=True): their "
            "curvature would be missing while n_data counts them"
            if sampler.drop_last
            else f"pads the shards by repeating {sampler.total_size - n} sample(s) "
            "(drop_last=False): they would be counted twice"
        )
        raise ValueError(
            f"rank {sampler.rank}: the DistributedSampler splits {n} samples over "
            f"{sampler.num_replicas} ranks and {what}. Use a data set whose size is divisible "
            f"by the world size (e.g. drop {n % sampler.num_replicas} sample(s) with a Subset "
            "first), or split it into per-rank Subsets yourself and wrap each rank's loader "
            "in lsn_ext.distributed.ShardedLoader"
        )


class _Size:
    """A stand-in dataset that only has a length (laplace-torch reads ``len(loader.dataset)``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class ShardedLoader:
    """A rank's loader over its own shard, reporting the summed size of all shards.

    For per-rank datasets (e.g. ``Subset(data, rank_indices)``), whose ``len(loader.dataset)`` is
    the shard's size: laplace-torch's ``fit`` reads that as ``n_data``. This wrapper iterates the
    loader unchanged and has ``len(self.dataset)`` equal to the sum over the ranks. It is a
    collective (all ranks construct it together) and checks that every rank has the same number
    of batches. Single process: the sizes are the loader's own.

    Args:
        loader: The rank's ``DataLoader`` over its shard (its sampler must not be a
            ``DistributedSampler``, whose dataset is already the full one).
        device: Device of the collective (default: CUDA for NCCL, else CPU).

    Raises:
        TypeError: For anything but a loader with a ``dataset`` and a length.
        ValueError: For a ``DistributedSampler``, or ranks with different numbers of batches.
    """

    def __init__(self, loader: Any, device: torch.device | str | None = None) -> None:
        if not hasattr(loader, "dataset") or not hasattr(loader, "__len__"):
            raise TypeError(
                f"ShardedLoader wraps a DataLoader over this rank's shard (it reads "
                f"len(loader.dataset) and len(loader)); got {type(loader).__name__}. Wrap a "
                "list of batches in a DataLoader first, e.g. DataLoader(TensorDataset(x, y), "
                "batch_size=...)"
            )
        if isinstance(getattr(loader, "sampler", None), DistributedSampler):
            raise ValueError(
                "ShardedLoader is for per-rank datasets; this loader's DistributedSampler "
                "already reports the full data set, pass the loader to fit() as it is"
            )
        self.loader = loader
        shard, batches = len(loader.dataset), len(loader)
        total = shard
        if world() is not None:
            if device is None:
                nccl = dist.get_backend() == "nccl"
                device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
            sizes = torch.tensor([shard], dtype=torch.int64, device=device)
            dist.all_reduce(sizes, op=dist.ReduceOp.SUM)
            total = int(sizes.item())
            ((lo, hi),) = all_reduce_range([batches], torch.device(device))
            if lo != hi:
                raise ValueError(
                    f"rank {dist.get_rank()}: this rank's loader has {batches} batches "
                    f"({shard} samples), but the ranks have between {lo} and {hi}. The fit "
                    "all-reduces every batch, so every rank needs the same number of batches: "
                    "split the data into equal shards, or pick the batch sizes so that the "
                    "counts agree"
                )
        self.dataset = _Size(total)
        self.shard_size = shard

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)
