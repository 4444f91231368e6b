"""Where the test suite's time goes: seconds per test, summed per file and per tier.

Record, with this module as a pytest plugin (CPU and wall seconds of each test's set-up, call and
tear-down; CPU counts this process and the subprocesses it waited for; the load average at the
start and at the end):

    .venv/bin/python -m pytest -p integration.checks.suite_times --suite-times=times.tsv [args]

The suite runs on one torch thread (``tests/conftest.py``), so a test's CPU seconds are close to
the wall time it would take on an idle core, however loaded the machine is when it is measured;
its wall seconds are the machine's at the time.

Summarise (totals per tier, the top files and the top tests, as Markdown):

    ./dev bench suite_times times.tsv [--top 20]

The output of ``pytest --durations=0`` (wall seconds only, no tier) is read as well.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)\s*$")


@dataclass
class Row:
    """One test: its node id, CPU and wall seconds, and tier (``None``: not recorded)."""

    nodeid: str
    cpu: float | None
    wall: float
    slow: bool | None

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


# -- recording (pytest plugin) -------------------------------------------------------------------


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--suite-times",
        metavar="PATH",
        help="write each test's CPU and wall seconds and tier to PATH (tab-separated)",
    )


_ROWS = pytest.StashKey[list[Row]]()
_START = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ROWS] = []
    config.stash[_START] = _load()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    slow = item.get_closest_marker("slow") is not None
    row = Row(item.nodeid, _cpu_seconds() - cpu, time.perf_counter() - wall, slow)
    item.config.stash[_ROWS].append(row)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--suite-times")
    if not path:
        return
    lines = [f"# load average (1, 5, 15 min): start {session.config.stash[_START]}, end {_load()}"]
    lines += [
        f"{r.cpu:.3f}\t{r.wall:.3f}\t{'slow' if r.slow else 'fast'}\t{r.nodeid}"
        for r in session.config.stash[_ROWS]
    ]
    Path(path).write_text("\n".join(lines) + "\n")


# -- summarising ---------------------------------------------------------------------------------


def read(path: Path) -> tuple[list[Row], list[str]]:
    """The rows of a ``--suite-times`` file or of ``--durations=0`` output, and its comments."""
    text = path.read_text().splitlines()
    if any("\t" in ln for ln in text):
        comments = [ln[2:] for ln in text if ln.startswith("# ")]
        rows = []
        for ln in text:
            if ln.startswith("#") or not ln.strip():
                continue
            cpu, wall, tier, nodeid = ln.split("\t")
            rows.append(Row(nodeid, float(cpu), float(wall), tier == "slow"))
        return rows, comments
    walls: dict[str, float] = defaultdict(float)
    for ln in text:
        m = _DURATION.match(ln)
        if m:
            walls[m.group(3)] += float(m.group(1))
    note = "pytest --durations output: wall seconds of the phases it lists (not those < 0.005 s)"
    return [Row(k, None, v, None) for k, v in walls.items()], [note]


def _seconds(rows: list[Row], attr: str) -> str:
    values = [getattr(r, attr) for r in rows]
    return "–" if any(v is None for v in values) else f"{sum(values):.1f}"


def report(rows: list[Row], comments: list[str], top: int) -> str:
    """Markdown: totals per tier, the ``top`` files and the ``top`` tests (by CPU if recorded)."""
    key = "cpu" if all(r.cpu is not None for r in rows) else "wall"
    out = [f"- {c}" for c in comments]
    out += ["", "| tier | tests | CPU s | wall s |", "|---|---:|---:|---:|"]
    tiers = {"all": rows}
    if all(r.slow is not None for r in rows):
        tiers |= {"fast": [r for r in rows if not r.slow], "slow": [r for r in rows if r.slow]}
    for name, part in tiers.items():
        out.append(f"| {name} | {len(part)} | {_seconds(part, 'cpu')} | {_seconds(part, 'wall')} |")
    files: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        files[r.file].append(r)
    ranked = sorted(files.items(), key=lambda kv: -sum(getattr(r, key) for r in kv[1]))
    out += ["", f"Top {top} files by {key} seconds:", ""]
    out += ["| file | tests | CPU s | wall s |", "|---|---:|---:|---:|"]
    for name, part in ranked[:top]:
        out.append(f"| {name} | {len(part)} | {_seconds(part, 'cpu')} | {_seconds(part, 'wall')} |")
    out += ["", f"Top {top} tests by {key} seconds:", ""]
    out += ["| test | tier | CPU s | wall s |", "|---|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: -getattr(r, key))[:top]:
        tier = "–" if r.slow is None else ("slow" if r.slow else "fast")
        cpu = "–" if r.cpu is None else f"{r.cpu:.2f}"
        out.append(f"| `{r.nodeid}` | {tier} | {cpu} | {r.wall:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("path", type=Path, help="a --suite-times file or --durations=0 output")
    parser.add_argument("--top", type=int, default=20, help="files and tests listed (20)")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        parser.error(f"{args.path}: no such file (record one with --suite-times=PATH)")
    if args.top < 1:
        parser.error(f"--top must be at least 1, got {args.top}")
    rows, comments = read(args.path)
    if not rows:
        parser.error(f"{args.path}: no test times (neither --suite-times nor --durations lines)")
    print(report(rows, comments, args.top), end="")


if __name__ == "__main__":
    main()
