"""Helpers shared by the benchmark scripts in this folder."""

import argparse
import multiprocessing
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def machine() -> str:
    """One line describing the CPU, Python and torch threading, for benchmark headers."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"Machine: {cpu}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}, "
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()} (interop "
        f"{torch.get_num_interop_threads()})."
    )


def report(title: str, body: Callable[[], str], quick: bool, results: Path) -> None:
    """Print ``title``, the machine line and ``body()`` with the total time; save unless quick."""
    t0 = time.perf_counter()
    sections = [
        title + (" (--quick)" if quick else ""),
        machine(),
        body(),
        f"Total benchmark time: {time.perf_counter() - t0:.0f} s.",
    ]
    text = "\n\n".join(sections) + "\n"
    print("\n" + text)
    if not quick:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(text)
        print(f"written to {results}")


def quick_benchmark_main(
    doc: str,
    title: str,
    run: Callable[[bool], str],
    results: Path,
    threads: int,
    argv: list[str] | None = None,
) -> None:
    """The command line of a benchmark with only ``--quick``: parse, set threads, :func:`report`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    torch.set_num_threads(threads)
    report(title, lambda: run(args.quick), args.quick, results)


def run_units(
    name: str,
    fn: Callable[[tuple], tuple[object, float]],
    work: Sequence[tuple],
    workers: int,
    on_done: Callable[[object, float], None] | None = None,
) -> None:
    """Run ``fn`` on every work item, in ``workers`` spawned processes when there are several.

    ``fn(item)`` returns ``(key, seconds)``; ``on_done(key, seconds)`` runs in this process as
    each unit finishes (e.g. to record its cost), and a progress line is printed. ``fn`` must be
    importable from a worker (a module-level function of the script).
    """
    t0 = time.perf_counter()

    def done(key: object, seconds: float) -> None:
        if on_done is not None:
            on_done(key, seconds)
        print(f"[{name}] {key}: {seconds:.0f} s", flush=True)

    if workers > 1 and len(work) > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for key, seconds in pool.imap_unordered(fn, work):
                done(key, seconds)
    else:
        for item in work:
            done(*fn(item))
    if work:
        print(f"[{name}] all units: {time.perf_counter() - t0:.0f} s wall", flush=True)
