"""The CPU KV pools ask for transparent huge pages before their first touch (engine.runner.huge_pages)."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelArgs
from engine.runner.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, thp_mode
from engine.runner.kv_cache import KVCache

THP_ON = thp_mode() in ("always", "madvise")


def test_nothing_to_advise_below_one_aligned_huge_page_or_off_the_cpu():
    assert advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)) is False
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8, device="meta")) is False


def huge_bytes_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `t`'s first 2 MB-aligned byte (/proc/self/smaps),
    in bytes: the advice splits the mapping there."""
    addr, inside = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:                # a mapping's first line: start-end ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not THP_ON, reason=f"transparent huge pages are {thp_mode() or 'unknown'} here")
def test_kv_pools_are_zero_and_get_huge_pages():
    args = ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=2, intermediate_size=128, vocab_size=32)
    # 2 layers × [2, 10240 blocks, 16, 2 heads, 32 dims] bf16 = 40 MB a layer.
    cache = KVCache(args, num_blocks=10240, block_size=16, dtype=torch.bfloat16)
    assert all(int(layer.count_nonzero()) == 0 for layer in cache.layers)
    # At least one 2 MB page under each pool (the kernel may fall back to 4 KB pages for some of
    # it when it finds no free huge page; every aligned 2 MB of a pool is asked for).
    for layer in cache.layers:
        assert huge_bytes_under(layer) >= HUGE_PAGE_BYTES
