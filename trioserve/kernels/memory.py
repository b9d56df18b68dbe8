"""The KV pool: resident only where written; on transparent huge pages
when asked (`--kv-huge-pages`).

Resident memory: the pool is anonymous memory from the kernel, which is
zero-filled page by page on first touch, so it is all zeros without being
written and costs resident memory only for the blocks serving has used.
Writing the zeros instead made the whole pool (512 MiB by default)
resident at start.

Huge pages cost that: the pool is [layers, KV heads, blocks, ...], so one
sequence's first block touches every (layer, KV head) span of the pool,
and on 2 MiB pages each touch makes a whole 2 MiB resident: the first
request made a 1B model's 256 MiB pool wholly resident (bench/README.md,
"Resident memory"). So they are an option, for a server whose pool fills
anyway.

Why: decode attention reads a sequence's blocks where they lie, and after
a while of serving they lie scattered over the whole pool. With 4 KiB
pages nearly every block (2 KiB per KV head for the default model) is
another page and another TLB miss. Over 30 layers' pools (32 rows, 171
keys each), the attention kernel ran 1.12-1.20x faster on 2 MiB pages
with scattered blocks and 1.05x with each sequence's blocks in one run
(bench/attention.py; bench/README.md, "The fourth round"). The weights,
read in order, gained nothing, so they stay as they are. The bytes are
the same either way: no result changes.

How: the memory is allocated untouched, `madvise(MADV_HUGEPAGE)` asks the
kernel to back the 2 MiB-aligned span inside it with huge pages, and only
then is it written. That works where transparent huge pages are
``always`` or ``madvise`` (most distributions' default); with ``never``,
or off Linux, the advice is refused or ignored and the tensor is an
ordinary one. libc's madvise, through ctypes, is the boundary."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages inside ``t``'s
    memory; True when the kernel took the advice. Pages already touched
    stay small, so call it before ``t`` is first written."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    start = t.untyped_storage().data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str = "cpu", huge_pages: bool = False) -> torch.Tensor:
    """``torch.zeros``; on the CPU, anonymous memory that becomes resident
    page by page as it is first written; with ``huge_pages``, 2 MiB pages
    where the system gives them."""
    size = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or size < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled by the kernel, lazily
    t = torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps ``region`` alive
    if huge_pages:
        advise_huge_pages(t)
    return t
