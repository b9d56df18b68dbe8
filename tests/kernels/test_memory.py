"""The KV pool's memory (kernels/memory.py): zeros like torch.zeros, and on
Linux with transparent huge pages enabled, backed by 2 MiB pages."""

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


def test_memory_smaller_than_a_huge_page_is_not_advised():
    assert memory.advise_huge_pages(torch.empty(1024)) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_big_pool_lies_on_huge_pages_where_the_system_gives_them():
    mode = _thp_mode()
    t = memory.zeros(((64 << 20) // 2,), dtype=torch.bfloat16)  # 64 MiB
    huge = _huge_kib_under(t.data_ptr() + (32 << 20))
    if mode in ("always", "madvise"):
        assert huge >= 16 << 10, f"transparent huge pages are {mode!r}, yet {huge} KiB of the pool is on them"
    else:
        assert mode in ("never", None) and huge == 0
    assert not t.any()
