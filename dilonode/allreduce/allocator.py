"""glibc malloc tuning for a process that moves large frames (`tune_allocator`)."""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["tune_allocator"]

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h) and the values tune_allocator sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_THRESHOLD = 256 << 20
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit hosts
_allocator_tuned = False


def tune_allocator() -> bool:
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the kernel.

    A round allocates and frees ~100 MB of 1 MB buffers (payloads that msgpack unpacks,
    encoded chunks) and a fresh result. By default glibc hands freed blocks above its
    trim threshold back to the kernel, so the next allocation page-faults its memory in
    again: on the shared 2-core benchmark machine a fresh buffer cost 3-5x a reused one,
    a large share of a float32 round's CPU. Here blocks up to 32 MB come from the heap and
    up to 256 MB of free heap per arena stays mapped. Process-wide, once; True if glibc
    took the settings (elsewhere it is a no-op returning False).
    """
    global _allocator_tuned
    if _allocator_tuned or not sys.platform.startswith("linux"):
        return _allocator_tuned
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no effect, others no symbol)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
                            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _allocator_tuned
