"""The cache of the experiments: trained networks, fitted posteriors and unit results on disk,
keyed by data set, network, factor, seed and the budget's hash, and each unit's wall time.

Entries are state dicts of tensors (networks; laplace-torch's ``state_dict`` and a dict of
numbers for posteriors) and JSON: no class of this package is pickled, so moving the code never
orphans a cache. Each is written through a temporary file, so a killed run leaves no half-written
entry.

- :class:`Cache`: the LSN paper's budget (networks trained for a fixed number of steps);
- :class:`ConvergedCache`: networks trained with early stopping on validation Dice, with a
  training record beside each;
- :func:`cached_json`: one JSON result per file; :func:`record_time`: a unit's wall time in the
  cache's ``timings`` file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from integration.experiments.kit.budget import Budget
from integration.experiments.kit.data import Data
from integration.experiments.kit.training import (
    EarlyStopping,
    NetSpec,
    build,
    train,
    validation_dice,
)


def cached_json(path: Path, compute: Callable[[], object]) -> object:
    """The JSON value in ``path``, or ``compute()`` written there (through a temporary file)."""
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
    return value


class Cache:
    """Networks, posteriors and unit results on disk, keyed by data set, factor, seed, budget."""

    def __init__(self, root: Path, budget: Budget):
        self.root, self.budget = root, budget
        root.mkdir(parents=True, exist_ok=True)

    def path(self, kind: str, *key: object, suffix: str = ".pt") -> Path:
        return self.root / ("-".join(map(str, (kind, *key, self.budget.key()))) + suffix)

    def net(self, spec: NetSpec, data: Data, factor: float, seed: int) -> nn.Module:
        path = self.path("net", data.name, spec.tag(), f"f{factor}", f"s{seed}")
        if path.exists():
            net = build(spec, self.budget, data.train_x.shape[1])
            net.load_state_dict(torch.load(path))
            return net.eval()
        net = train(spec, data, factor, seed, self.budget)
        self.save(net.state_dict(), path)
        return net

    @staticmethod
    def save(obj: object, path: Path) -> None:
        """Write through a temporary file, so that a killed run leaves no half-written entry."""
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        tmp.replace(path)

    def result(self, name: str, compute: Callable[[], dict]) -> dict:
        """The unit result ``name``: from its JSON file, or computed and stored there."""
        return cached_json(self.path("result", name, suffix=".json"), compute)

    def stored(self, name: str) -> dict | None:
        path = self.path("result", name, suffix=".json")
        return json.loads(path.read_text()) if path.exists() else None


class ConvergedCache(Cache):
    """:class:`Cache` whose networks train with early stopping on validation Dice;
    each network's training record (steps, best Dice, seconds) is kept beside it."""

    def net(self, spec: NetSpec, data: Data, factor: float, seed: int) -> nn.Module:
        return self.net_and_record(spec, data, factor, seed)[0]

    def net_and_record(
        self, spec: NetSpec, data: Data, factor: float, seed: int
    ) -> tuple[nn.Module, dict]:
        path = self.path("net", data.name, spec.tag(), f"f{factor}", f"s{seed}")
        record_path = path.with_suffix(".json")
        if path.exists() and record_path.exists():
            net = build(spec, self.budget, data.train_x.shape[1])
            net.load_state_dict(torch.load(path))
            return net.eval(), json.loads(record_path.read_text())
        b = self.budget
        stopping = EarlyStopping(
            lambda n: validation_dice(n, data),
            b.eval_every,
            b.patience,
            b.min_steps,
            b.stop_floor,
        )
        t0 = time.perf_counter()
        net = train(spec, data, factor, seed, b, stopping)
        record = {
            "best_step": stopping.best_step,
            "steps_run": stopping.steps_run,
            "stopped_early": stopping.stopped,
            "best_val_dice": stopping.best_score,
            "seconds": time.perf_counter() - t0,
        }
        self.save(net.state_dict(), path)
        record_path.write_text(json.dumps(record))
        return net, record


def record_time(cache: Cache, key: tuple, seconds: float) -> None:
    """Print a unit's time and keep it in the cache's ``timings.json`` (computed units only)."""
    print(f"[lsn_paper] {'/'.join(map(str, key))}: {seconds:.0f} s", flush=True)
    path = cache.path("timings", suffix=".json")
    timings = json.loads(path.read_text()) if path.exists() else {}
    if seconds > 5 or "/".join(map(str, key)) not in timings:
        timings["/".join(map(str, key))] = seconds
    path.write_text(json.dumps(timings, indent=0))
