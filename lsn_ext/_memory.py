"""A sample count checked against the device's memory before the samples are allocated.

Functions that hold all their Monte-Carlo samples at once (``mc_samples``, ``n_samples``,
``n_aleatoric``) otherwise fail deep in torch's allocator ("DefaultCPUAllocator: can't allocate
memory: you tried to allocate 1024000000000 bytes"), without a word about the argument.
"""

from __future__ import annotations

import os

import torch


def device_memory(device: torch.device) -> int | None:
    """Total memory in bytes of ``device``: physical RAM for the CPU, ``None`` where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # not POSIX
            return None
    return None


def check_sample_memory(
    argument: str, count: int, numel_per_sample: int, like: torch.Tensor, remedy: str
) -> None:
    """Refuse ``count`` samples that cannot fit the memory of ``like``'s device.

    Only a count whose samples alone need more than the device's total memory is refused (it
    cannot succeed); anything smaller is left to the allocator.

    Args:
        argument: The caller's name for the count, e.g. ``"mc_samples"``.
        count: The number of samples.
        numel_per_sample: Numbers held per sample, in ``like``'s dtype.
        like: A tensor of the samples' dtype and device.
        remedy: What to do instead, appended to the message.

    Raises:
        ValueError: Naming the argument, the memory it needs and the device's.
    """
    total = device_memory(like.device)
    need = count * numel_per_sample * like.element_size()
    if total is None or need <= total:
        return
    fits = total // max(numel_per_sample * like.element_size(), 1)
    raise ValueError(
        f"{argument}={count} needs {need / 2**30:.4g} GiB for its samples ({numel_per_sample} "
        f"{like.dtype} numbers each), more than the {total / 2**30:.4g} GiB of memory of the "
        f"{like.device.type} device (which would hold at most {fits} such samples and nothing "
        f"else): {remedy}"
    )
