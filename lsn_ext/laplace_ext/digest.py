"""The device-side fingerprint of a batch that seeds :class:`DiagBackprop`'s Monte-Carlo vectors.

On the CPU the backend hashes a batch's bytes (:func:`tensor_bytes`); on an accelerator it hashes
two 31-bit sums of them computed on the device (:func:`batch_digest`), so that the batch is not
copied to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DIGEST_LCGS", "DIGEST_LCGS_CHUNK", "batch_digest", "tensor_bytes"]


def tensor_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, for hashing (no copy for a contiguous tensor)."""
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


# (prime p, multiplier a, offset b) of the two 31-bit sums of batch_digest.
DIGEST_LCGS = ((2_147_483_647, 1_103_515_245, 12_345), (2_147_483_629, 1_664_525, 1_013_904_223))
DIGEST_LCGS_CHUNK = 2**22  # words per step: bounds the int64 temporaries to 32 MiB each


def batch_digest(t: Tensor) -> Tensor:
    """Two 31-bit fingerprints of ``t``'s bytes, computed on its device: int64 ``[2]``.

    The bytes are read as 32-bit words (16- or 8-bit words for narrower dtypes); word ``u_i``
    contributes ``((u_i + a·i + b) mod p)² mod p``, summed mod ``p``, for two primes ``p`` just
    below 2³¹ (words that agree mod one prime differ mod the other). Every intermediate fits in
    int64 and integer sums are exact, so the result does not depend on the reduction order: it
    is the same on every run and device, and only these two numbers need reach the host. (On
    the CPU, where the bytes are at hand, hashing them is cheaper: see ``_batch_generator``.)

    Args:
        t: Any tensor, on any device.

    Returns:
        int64 ``[2]`` on ``t``'s device, each entry in ``[0, 2³¹)``.
    """
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    words = flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)
    sums = []
    for p, a, b in DIGEST_LCGS:
        acc = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), DIGEST_LCGS_CHUNK):
            u = words[start : start + DIGEST_LCGS_CHUNK].long()
            i = torch.arange(start, start + u.numel(), device=u.device)
            if start + u.numel() > p:
                i = i % p
            x = (u + a * i + b) % p
            acc = (acc + (x * x % p).sum()) % p
        sums.append(acc)
    return torch.stack(sums)
