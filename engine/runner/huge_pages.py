"""Transparent huge pages for the CPU KV pools.

A long-running server hands out KV blocks in a scattered order, so a decode step reads each row's
16-token blocks from all over a layer's pool. With 4 KB pages every block sits in its own pages
and a scattered block table costs a TLB miss every few KB, a two-level page walk under a
hypervisor. Linux backs an anonymous mapping with 2 MB pages where the process asks
(`madvise(MADV_HUGEPAGE)`, transparent_hugepage mode "madvise") or everywhere (mode "always").
Most distributions ship "madvise", so nothing gets them unasked. The advice works on memory not
touched yet (the kernel then faults whole 2 MB pages in); memory the allocator hands out again
needs collapsing (MADV_COLLAPSE).
docs/benchmarks/kernels.md ("Decode attention at long contexts") has the decode-attention figures
for both layouts; benchmarks/results/kernels/history.md ("The KV cache on huge pages") those of
this module's pools.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14                  # Linux <asm-generic/mman-common.h>
MADV_COLLAPSE = 25                  # the same header, Linux 6.1+
HUGE_PAGE_BYTES = 2 << 20           # x86-64 and arm64 (4 KB base pages) PMD size
THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "" where unknown
    (no such file: not Linux, or a kernel without THP)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def _madvise(t: torch.Tensor, advice: int) -> bool:
    """madvise(`advice`) over the 2 MB-aligned part of CPU tensor `t`'s memory; False where that
    part is empty, THP is off or unknown, or madvise refuses (errno logged at debug level)."""
    if t.device.type != "cpu" or thp_mode() not in ("always", "madvise"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(lo, hi - lo, advice) != 0:
        log.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
        return False
    return True


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for 2 MB pages under the 2 MB-aligned part of CPU tensor `t`'s memory.

    Call it before anything touches `t` (e.g. on `torch.empty`, then fill): the first touch then
    faults in whole 2 MB pages. Memory touched before keeps its 4 KB pages, and that includes
    heap memory the process freed and malloc hands out again: `collapse_huge_pages` after the
    fill converts those. Returns True where the kernel took the advice, False where it cannot
    apply: less than one aligned huge page, THP mode "never" or unknown, or madvise refusing.
    Never raises: the pool works either way, only slower to read.
    """
    return _madvise(t, MADV_HUGEPAGE)


def collapse_huge_pages(t: torch.Tensor) -> bool:
    """Turn the 4 KB pages under the 2 MB-aligned part of `t`'s memory into 2 MB pages now
    (MADV_COLLAPSE, Linux 6.1 and later; it copies what is there, so `t` keeps its contents).

    Returns False where it cannot apply (as `advise_huge_pages`; older kernels refuse the advice
    with EINVAL) or the kernel found no free huge pages for all of it. Never raises.
    """
    return _madvise(t, MADV_COLLAPSE)


def huge_page_bytes() -> int:
    """This process's anonymous memory in huge pages, in bytes (AnonHugePages of
    /proc/self/smaps_rollup); 0 where unknown."""
    try:
        for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
