"""The KV pool's memory (kernels/memory.py): zeros like torch.zeros,
resident only where written, and on Linux with transparent huge pages
enabled, backed by 2 MiB pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trioserve.kernels import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _huge_kib_under(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_are_zeros_of_the_shape_and_dtype_asked():
    t = memory.zeros((3, 5, 7), dtype=torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert torch.equal(t, torch.zeros(3, 5, 7, dtype=torch.bfloat16))
    t[1, 2, 3] = 4
    assert t.sum().item() == 4


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3 << 20)])
def test_zeros_small_and_big_are_zeros_and_writable(shape):
    t = memory.zeros(shape, dtype=torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    flat = t.view(-1)
    flat[-1] = 2
    flat[0] = 1
    assert t.sum().item() == 3 and t.reshape(-1)[-1].item() == 2


def _rss() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")).split()[1]) << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_a_pool_is_resident_only_where_written():
    """A 256 MiB pool adds (about) nothing to resident memory until written,
    then about the part written."""
    before = _rss()
    t = memory.zeros((64, 1 << 20), dtype=torch.float32)  # 256 MiB
    made = _rss() - before
    t[:8].fill_(1.0)  # 32 MiB
    written = _rss() - before
    assert made < 16 << 20, f"an unwritten 256 MiB pool is {made >> 20} MiB resident"
    assert 32 << 20 <= written < 64 << 20, written >> 20
    assert t[:8].eq(1).all() and not t[8:].any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_pool_is_on_small_pages_unless_asked():
    t = memory.zeros(((64 << 20) // 2,), dtype=torch.bfloat16)  # 64 MiB
    t.fill_(1)
    assert _huge_kib_under(t.data_ptr() + (32 << 20)) == 0 or _thp_mode() == "always"


def test_memory_smaller_than_a_huge_page_is_not_advised():
    assert memory.advise_huge_pages(torch.empty(1024)) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_big_pool_lies_on_huge_pages_where_the_system_gives_them():
    mode = _thp_mode()
    t = memory.zeros(((64 << 20) // 2,), dtype=torch.bfloat16, huge_pages=True)  # 64 MiB
    assert not t.any()  # reading maps the shared zero page (no huge pages yet): only a write backs memory
    t.fill_(0)
    huge = _huge_kib_under(t.data_ptr() + (32 << 20))
    if mode in ("always", "madvise"):
        assert huge >= 16 << 10, f"transparent huge pages are {mode!r}, yet {huge} KiB of the pool is on them"
    else:
        assert mode in ("never", None) and huge == 0
    assert not t.any()
