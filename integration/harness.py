"""What every integration script shares: paths, the machine line, a benchmark's report, the
unit runner, wall-clock timing, peak-memory counters and the cost benchmarks' workload.

- :data:`ROOT`, :data:`RESULTS`: the repository and ``integration/results/``;
- :func:`machine`, :func:`report`, :func:`quick_benchmark_main`: a report's header and a
  benchmark's command line;
- :func:`run_units`: units of work in spawned processes, with progress lines;
- :func:`timed`: ``(fn(), seconds)``; :func:`timed_wall_cpu`: wall and CPU seconds on a device;
- :func:`run_worker`: a script's own worker in a fresh process, its last line as JSON;
  :func:`pool_runs`: the timings of several such processes, pooled per method;
- :func:`peak_increase`, :func:`memory_counter`: peak memory of one call, and what it reads;
  :func:`run_header`: a report's run line;
- :func:`error_cell`, :func:`median_range`, :func:`table_row`, :func:`git_revision`: a
  report's cells, rows and code line;
- :func:`script_command`, :func:`script_env`: a script (or its own worker) in a fresh process
  as ``python -m integration.<role>.<name>``, importable from any working directory;
- :func:`rss_bytes`, :func:`maxrss_bytes`, :func:`hwm_bytes`, :func:`reset_peak`,
  :data:`MALLOC_ENV`: the resident-memory counters of ``/proc/self`` (Linux) and the glibc
  settings under which the resident size follows the live tensors;
- :func:`paper_unet`, :func:`random_batch`: the LSN paper's U-Net and a random batch of it.
"""

import argparse
import gc
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from lsn_ext.models import UNet

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "integration" / "results"
# glibc's dynamic mmap threshold would keep a warm-up's freed blocks in the heap, where the
# measured op reuses them without raising the RSS (peaks 30-40% too low at 128²); a fixed
# threshold and trimming make the RSS follow the live allocations (torch's CPU allocator does
# not cache). glibc reads them at start-up: set them in a fresh process's environment.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


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


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``(fn(), its wall-clock seconds)`` (``time.perf_counter``)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def script_command(module: str, *args: str) -> list[str]:
    """``python -m module *args`` with this interpreter (e.g. ``__spec__.name`` for a script's
    own worker); run it with :func:`script_env` so that it imports from any folder."""
    return [sys.executable, "-m", module, *args]


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def rss_bytes() -> int:
    """The resident set size of this process now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in bytes (KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hwm_bytes() -> int | None:
    """VmHWM: the peak RSS of this address space (the counter ``ru_maxrss`` is built on)."""
    try:
        with open("/proc/self/status") as f:
            line = next(ln for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS via ``/proc/self/clear_refs`` (Linux ≥ 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm = hwm_bytes()
    return hwm is not None and hwm <= rss_bytes() + 2**20


def paper_unet(out_channels: int = 1) -> nn.Module:
    """The LSN paper's U-Net: 3 → 1 channels, widths 8-16-32-64-128, two 3×3 convs + tanh.

    Conv2d, max pooling, nearest upsampling and concatenating skips (the network where
    laplace-torch + curvlinops ``kron`` also run). ``out_channels=2``: the same network with
    two output channels, for cross-entropy.
    """
    return UNet(3, out_channels, widths=(8, 16, 32, 64, 128), activation=nn.Tanh, convs_per_block=2)


def random_batch(batch: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard-normal images ``[batch, 3, size, size]`` and Bernoulli(½) masks of one channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = (torch.rand(batch, 1, size, size, generator=g) > 0.5).float()
    return x, y


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_wall_cpu(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (``time.process_time``: all threads) of ``fn()``."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def error_cell(err: BaseException) -> str:
    """The error in one short table cell."""
    lines = str(err).strip().splitlines() or [""]
    text = f"{type(err).__name__}: {lines[0]}".replace("|", "/")
    return text if len(text) <= 140 else text[:137] + "..."


def table_row(*cells: str) -> str:
    """One row of a Markdown table: ``| a | b |``."""
    return "| " + " | ".join(cells) + " |"


def median_range(values: Sequence[float]) -> str:
    """``median (min–max)`` with two decimals."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def git_revision() -> str:
    """The checkout's commit, and whether tracked code outside the results differs from it."""
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":!integration/results"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes" if changed else commit


def run_worker(
    module: str, flag: str, spec: dict | list, extra_env: dict[str, str] | None = None
) -> tuple[list[str], dict | list]:
    """Run ``module`` as its own worker (``flag`` with ``spec`` as JSON) in a fresh process on
    this process's torch threads, with ``extra_env`` added to its environment.

    Returns the lines it printed before its last, and its last line parsed as JSON.

    Raises:
        RuntimeError: The worker failed, with its standard error.
    """
    cmd = script_command(module, flag, json.dumps(spec))
    cmd += ["--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, capture_output=True, text=True, env=script_env(**(extra_env or {})))
    if out.returncode != 0:
        raise RuntimeError(f"worker {flag} {spec} failed:\n{out.stderr}")
    *lines, last = out.stdout.strip().splitlines()
    return lines, json.loads(last)


def pool_runs(runs: list[dict[str, dict]], keys: Sequence[str]) -> dict[str, dict]:
    """Per method, its lists under ``keys`` pooled over the runs of fresh processes (in order),
    and ``medians``: each run's median of ``ratios``; a method with ``error`` or ``skip`` in
    any run is that run's entry (failing in one process is failing)."""
    pooled: dict[str, dict] = {}
    for m in runs[0]:
        failed = next((run[m] for run in runs if "error" in run[m] or "skip" in run[m]), None)
        if failed is not None:
            pooled[m] = failed
            continue
        pooled[m] = {k: [t for run in runs for t in run[m][k]] for k in keys if k in runs[0][m]}
        pooled[m]["medians"] = [statistics.median(run[m]["ratios"]) for run in runs]
    return pooled


def peak_increase(call: Callable[[], object], device: str) -> tuple[int, int]:
    """``(baseline, peak − baseline)`` bytes of one ``call()``: on CUDA from
    ``torch.cuda.max_memory_allocated``, on CPU from the kernel's peak-RSS counter (VmHWM, reset
    through ``/proc/self/clear_refs``; run under :data:`MALLOC_ENV` so that the RSS follows the
    live tensors)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        return base, torch.cuda.max_memory_allocated() - base
    if not reset_peak():
        raise RuntimeError("peak memory on CPU needs /proc/self/clear_refs (Linux ≥ 4.0)")
    base = rss_bytes()
    call()
    return base, hwm_bytes() - base


def memory_counter(device: str) -> str:
    """What :func:`peak_increase` reads on ``device``, in words, for a report."""
    if device.startswith("cuda"):
        return "`torch.cuda.max_memory_allocated()` − `memory_allocated()` before the call"
    return (
        "peak RSS (VmHWM, reset via `/proc/self/clear_refs` after the warm-up) − RSS before the "
        "call; CUDA's `max_memory_allocated` not measured: "
        + (
            "run with `--device cuda`"
            if torch.cuda.is_available()
            else "no GPU here (`torch.cuda.is_available()` is False)"
        )
    )


def run_header(device: str, command: str) -> str:
    """A benchmark report's run line: machine, device, command, code revision and load."""
    load = os.getloadavg()
    cpus = os.cpu_count() or 1
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name(device)})"
    busy = (
        f" The load exceeded the {cpus} logical CPUs: other jobs shared the machine, so the "
        "times are contended; the paired ratios are the figures least affected."
        if load[0] > cpus
        else ""
    )
    return (
        f"{machine()} Device: {device}. Command: `{command}`. Code: {git_revision()}. Load average "
        f"(1, 5, 15 min) at the start: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}.{busy}"
    )
