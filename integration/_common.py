"""Helpers shared by the benchmark scripts in this folder."""

import os
import platform

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
