"""Data-parallel fits (:mod:`lsn_ext.distributed`): two gloo processes against one process.

One pair of spawned processes (``world_size=2``, ``gloo``, TCP on 127.0.0.1) runs every
scenario in :func:`_scenarios` and saves what each rank holds; the tests compare those results
with single-process fits computed here. The pair is started once per module (a fixture with a
timeout), which keeps the file at a few seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import lsn_ext
from lsn_ext.distributed import ShardedLoader, check_loader, unwrap
from lsn_ext.exact import exact_ggn_diagonal, flatten_diagonals

WORLD = 2
TIMEOUT_S = 60
N_TRAIN = 8


def _model() -> nn.Module:
    """A tiny conv net ``[N, 1, 8, 8] → [N, 2, 8, 8]``, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 1)).double()


def _data(n: int = N_TRAIN, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 2, (n, 8, 8), generator=g))


def _laplace(model: nn.Module, **backend_kwargs: Any) -> Any:
    return Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
        backend_kwargs=backend_kwargs,
    )


def _fit(loader: Any, model: nn.Module | None = None, **backend_kwargs: Any) -> Any:
    la = _laplace(_model() if model is None else model, **backend_kwargs)
    la.fit(loader)
    return la


def _summary(la: Any) -> dict[str, Any]:
    return {"H": la.H.clone(), "loss": float(la.loss), "n_data": la.n_data}


def _error(fn: Any) -> str | None:
    """The message of the ``ValueError`` that ``fn()`` raises, or ``None``."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _failure(fn: Any) -> str | None:
    """``"Type: message notes"`` of whatever ``fn()`` raises, or ``None``."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}"
    return None


def _scenarios(rank: int) -> dict[str, Any]:
    """Everything rank ``rank`` computes; the ranks run the same collectives in the same order."""
    import torch.distributed as dist

    data = _data()
    out: dict[str, Any] = {}

    def sharded(dataset: Any = data, **kwargs: Any) -> DataLoader:
        sampler = DistributedSampler(dataset, shuffle=False, **kwargs)
        return DataLoader(dataset, batch_size=2, sampler=sampler)

    # Diagonal backprop: the same numbers as one process, to round-off.
    la = _fit(sharded(), estimator="db")
    out["db"] = _summary(la)
    la.optimize_prior_precision(method="marglik", n_steps=50)
    out["marglik"] = la.prior_precision.clone()

    # Monte Carlo, twice with the same seed: reproducible; and many vectors: near the exact GGN.
    out["mc"] = [_summary(_fit(sharded(), estimator="mc", seed=3)) for _ in range(2)]
    out["mc_many"] = _summary(_fit(sharded(), estimator="mc", mc_samples=256, seed=4))

    # Identical batches on both ranks still get different vectors.
    x, y = data.tensors[0][:2], data.tensors[1][:2]
    reduced = _laplace(_model(), estimator="mc").backend.diag(x, y)[1]
    alone = _laplace(_model(), estimator="mc", distributed=False).backend.diag(x, y)[1]
    out["same_batch"] = {"reduced": reduced, "alone": alone}

    # A DDP-wrapped model: the backend runs on model.module.
    ddp = nn.parallel.DistributedDataParallel(_model())
    out["ddp"] = _summary(_fit(sharded(), model=ddp, estimator="db"))

    # Per-rank datasets through ShardedLoader.
    shard = Subset(data, range(rank * 4, rank * 4 + 4))
    out["subset"] = _summary(_fit(ShardedLoader(DataLoader(shard, batch_size=2)), estimator="db"))
    # ... and without it: n_data=4, but the first batches of the ranks hold 3 + 3 samples. (With
    # batch_size=2 the first batches would sum to exactly 4 and look like a complete fit.)
    out["subset_error"] = _error(lambda: _fit(DataLoader(shard, batch_size=3), estimator="db"))

    # Opt-out: each rank's own shard.
    out["opt_out"] = _summary(_fit(sharded(), estimator="db", distributed=False))

    # Padding: 7 samples on 2 ranks repeat one; refused up front and by the backend.
    padded = sharded(Subset(data, range(7)))
    out["padded_check"] = _error(lambda: check_loader(padded))
    out["padded_fit"] = _error(lambda: _fit(padded, estimator="db"))
    out["dropped_check"] = _error(
        lambda: check_loader(sharded(Subset(data, range(7)), drop_last=True))
    )

    # Silently wrong before: per-rank shards (no ShardedLoader) whose first batches sum to
    # exactly n_data; batch counts that differ between the ranks; a fit after a short one.
    out["subset_exact_sum"] = _error(lambda: _fit(DataLoader(shard, batch_size=2), estimator="db"))
    uneven = DataLoader(data, batch_size=2 if rank == 0 else 1, sampler=sharded().sampler)
    out["uneven_batches"] = _error(lambda: _fit(uneven, estimator="db"))
    dropping = sharded(Subset(data, range(7)), drop_last=True)
    out["dropped_fit"] = _error(lambda: _fit(dropping, estimator="db"))
    out["after_uneven"] = _summary(_fit(sharded(), estimator="db"))

    # A NaN image in rank 1's shard only (sample 1): every rank raises, none waits forever.
    poisoned = _data()
    if rank == 1:
        poisoned.tensors[0][1, 0, 0, 0] = float("nan")
    out["nan_on_one_rank"] = _failure(lambda: _fit(sharded(poisoned), estimator="db"))

    # The process group still works after those errors (all ranks raised together).
    out["after_errors"] = _summary(_fit(sharded(), estimator="db"))

    # Grid search on a sharded validation set, and per-rank predictions gathered.
    val = _data(4, seed=2)
    val_loader = DataLoader(val, batch_size=2, sampler=DistributedSampler(val, shuffle=False))
    res = lsn_ext.gridsearch_prior_precision(la, val_loader, grid=[0.1, 1.0, 10.0], n_samples=4)
    out["grid"] = {"prior": res.prior_precision, "scores": res.scores}
    pred = lsn_ext.predict(la, val.tensors[0][rank * 2 : rank * 2 + 2], n_samples=4)
    maps = [torch.empty_like(pred.mean) for _ in range(dist.get_world_size())]
    dist.all_gather(maps, pred.mean)
    out["gathered"] = torch.cat(maps)
    return out


def _worker(rank: int, port: int, path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # as conftest.py does for the reference fits
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        try:
            torch.save(_scenarios(rank), f"{path}/rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(f"{path}/rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The results of both ranks (one spawned pair per module, killed after ``TIMEOUT_S``)."""
    path = tmp_path_factory.mktemp("distributed")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(path.glob("*.err"))]
    if errors or any(p.exitcode for p in procs):
        pytest.fail(f"exit codes {[p.exitcode for p in procs]}:\n" + "\n".join(errors))
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _full_loader() -> DataLoader:
    return DataLoader(_data(), batch_size=2)


def _assert_same(got: dict[str, Any], want: Any) -> None:
    torch.testing.assert_close(got["H"], want.H, rtol=1e-10, atol=1e-12)
    assert got["loss"] == pytest.approx(float(want.loss), rel=1e-10)
    assert got["n_data"] == want.n_data == N_TRAIN


@pytest.mark.slow
def test_db_fit_equals_single_process(ranks: list[dict[str, Any]]) -> None:
    want = _fit(_full_loader(), estimator="db")
    for out in ranks:
        _assert_same(out["db"], want)
        _assert_same(out["after_errors"], want)


@pytest.mark.slow
def test_ddp_wrapped_model_equals_single_process(ranks: list[dict[str, Any]]) -> None:
    want = _fit(_full_loader(), estimator="db")
    for out in ranks:
        _assert_same(out["ddp"], want)


@pytest.mark.slow
def test_sharded_loader_over_per_rank_subsets(ranks: list[dict[str, Any]]) -> None:
    want = _fit(_full_loader(), estimator="db")
    for out in ranks:
        _assert_same(out["subset"], want)
        assert "6 samples, more than len(train_loader.dataset)=4" in out["subset_error"]
        assert "ShardedLoader" in out["subset_error"]


@pytest.mark.slow
def test_marglik_prior_is_the_same_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    want = _fit(_full_loader(), estimator="db")
    want.optimize_prior_precision(method="marglik", n_steps=50)
    torch.testing.assert_close(ranks[0]["marglik"], ranks[1]["marglik"], rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["marglik"], want.prior_precision, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_mc_fit_reproducible_identical_on_ranks_and_unbiased(
    ranks: list[dict[str, Any]],
) -> None:
    runs = [out["mc"] + [out["mc_many"]] for out in ranks]
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a["H"], b["H"], rtol=0, atol=0)
        assert a["n_data"] == N_TRAIN
    first, again = ranks[0]["mc"]
    torch.testing.assert_close(first["H"], again["H"], rtol=0, atol=0)
    # The MC loss is the exact loss, summed over both shards.
    want = _fit(_full_loader(), estimator="db")
    assert first["loss"] == pytest.approx(float(want.loss), rel=1e-10)
    x, y = _data().tensors
    model = _model()
    exact = flatten_diagonals(model, exact_ggn_diagonal(model, x, y, lsn_ext.CrossEntropy()))
    H = ranks[0]["mc_many"]["H"]
    assert ((H - exact).norm() / exact.norm()).item() < 0.1


@pytest.mark.slow
def test_identical_batches_get_different_vectors_per_rank(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    torch.testing.assert_close(first["same_batch"]["reduced"], second["same_batch"]["reduced"])
    # Without the rank in the seed both ranks would draw the same vectors: sum = 2 × one rank.
    twice = 2 * first["same_batch"]["alone"]
    assert not torch.allclose(first["same_batch"]["reduced"], twice)


@pytest.mark.slow
def test_opt_out_gives_the_shard_posterior(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        shard = Subset(_data(), range(rank, N_TRAIN, WORLD))  # DistributedSampler's interleaving
        want = _fit(DataLoader(shard, batch_size=2), estimator="db")
        torch.testing.assert_close(out["opt_out"]["H"], want.H, rtol=1e-10, atol=1e-12)
        assert out["opt_out"]["loss"] == pytest.approx(float(want.loss), rel=1e-10)
        assert out["opt_out"]["n_data"] == N_TRAIN  # len(loader.dataset): the full data set
    assert not torch.allclose(ranks[0]["opt_out"]["H"], ranks[1]["opt_out"]["H"])


@pytest.mark.slow
def test_padded_and_dropping_samplers_are_refused(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert f"rank {rank}" in out["padded_check"]
        assert "repeating 1 sample" in out["padded_check"]
        assert "drops the last 1 sample" in out["dropped_check"]
        assert "pads the shards by repeating 1 sample" in out["padded_fit"]
        assert "drops the last 1 sample" in out["dropped_fit"]
        assert "8 samples, more than len(train_loader.dataset)=4" in out["subset_exact_sum"]
        batches = 2 if rank == 0 else 4
        assert (
            f"rank {rank}: this rank's train_loader has {batches} batches, but the 2 ranks"
            in (out["uneven_batches"])
        )
    _assert_same(ranks[0]["after_uneven"], _fit(_full_loader(), estimator="db"))


@pytest.mark.slow
def test_an_error_on_one_rank_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    first, second = (out["nan_on_one_rank"] for out in ranks)
    assert second.startswith("ValueError: the batch's inputs")
    assert "NaN or infinite" in second
    assert "rank 1 of 2; every rank of the fit stopped with it: ranks [1]" in second
    assert first.startswith("RuntimeError: rank 0: rank(s) [1] could not fit their batch")
    _assert_same(ranks[0]["after_errors"], _fit(_full_loader(), estimator="db"))


@pytest.mark.slow
def test_gridsearch_and_predict_agree_across_ranks(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    assert first["grid"] == second["grid"]
    torch.testing.assert_close(first["gathered"], second["gathered"], rtol=0, atol=0)
    assert first["gathered"].shape == (4, 2, 8, 8)


def test_single_process_helpers() -> None:
    model = _model()
    assert unwrap(nn.DataParallel(model)) is model
    loader = _full_loader()
    check_loader(loader)  # no DistributedSampler: nothing to check
    wrapped = ShardedLoader(loader)
    assert len(wrapped.dataset) == N_TRAIN
    assert len(wrapped) == len(loader)
    with pytest.raises(TypeError, match=r"ShardedLoader wraps a DataLoader .* got list"):
        ShardedLoader(list(loader))
    with pytest.raises(TypeError, match="distributed must be a bool"):
        _laplace(model, distributed="yes").backend  # noqa: B018
