"""Keep freed CPU memory in the process, as PyTorch's CUDA caching allocator keeps device memory.

On CPU torch allocates through the C library's ``malloc``. glibc serves a request above its mmap
threshold (128 KiB at start, raised as large blocks are freed, up to 32 MiB) with a fresh ``mmap`` and
unmaps it when the tensor is freed, and it trims the top of the heap past twice that threshold. A
training step allocates and frees the same temporaries every step, so each step the kernel maps them
in again, a zeroed 4 KiB page at a time; and which of them fault depends on what the process
allocated before. Measured (2 gloo ranks, 1 thread each, mlp width 512 batch 64, its replicated plan,
one profiled step, `autoddl run --profile`): AdamW's step 4.3-6.0 ms of which the foreach ``sqrt``
(an output of 1M floats, 4 MB) 1.7-2.9 ms; 3.7 ms and 1.1 ms with the heap kept; the step's median
12.5 ms, 9.7 ms kept. The same plan read 9.5 ms in a fidelity study, timed after five other plans
whose freed blocks had raised the threshold, and on 4 ranks 25.5 ms alone against 14-21 ms after
others: the time of a step depended on the plans timed before it in the process.

:func:`keep_freed_memory` sets the threshold (which also stops glibc from moving it) to 32 MiB, the
ceiling glibc itself would raise it to, and the trim threshold out of reach, so that a step's freed
blocks serve the next step's. Tensors above 32 MiB are still mapped and unmapped each time. Every
process that runs or measures a step calls it first (executor/worker.py, executor/local_ranks.py: the
calibration ranks; ``autoddl.parallelize`` on CPU in a user's own script, unless told not to), so the
cost model is calibrated as the plans run. The memory kept is free for the
process to reuse, not lost; :func:`release_freed_memory` (``malloc_trim``) gives it back, as
``PeakMemory.start`` does before it takes the resident set a measurement starts from. Elsewhere than
glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1              # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20    # glibc's own ceiling for its moving threshold (64-bit)
TRIM_THRESHOLD_BYTES = (1 << 31) - 1   # mallopt takes an int: never trim on its own


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (no ``mallopt`` / ``malloc_trim``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds so freed blocks stay in the process (module docstring); False where the
    C library is not glibc or refused a value."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Give the free blocks the process keeps back to the kernel (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
