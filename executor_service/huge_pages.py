"""A CPU KV pool backed by transparent huge pages.

Decode attention walks each sequence's blocks of every layer; at 16 tokens a
block one kv head's rows are 4 KiB (fp32, D 64), a page of their own, and the
pool is far larger than what the TLB maps: with 4 KiB pages a walk over a
scattered block table (a pool after hours of churn) takes a page walk per
block. Backed by 2 MiB pages, 16 sequences x 1,450 tokens of the 30M Llama's
shapes, blocks in random order, attended in 965 against 1,109-1,240 us a
layer (in table order 801-820 against 819-849; docs/benchmarks.md).

glibc serves a pool with an mmap the kernel backs with huge pages only when
asked (Linux's default THP mode is ``madvise``), so the pool gets an
anonymous private mapping of its own, advised before its first touch, then
zeroed (faulted in at startup, as ``torch.zeros`` did). The kernel's THP
settings stay the operator's: with ``never`` the advice is a no-op, and how
much of the pool huge pages actually back is read back from
``/proc/self/smaps`` (``backed_bytes``: a fragmented host may give fewer).
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps")
HUGE_PAGE = 2 << 20


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode (``always`` / ``madvise`` /
    ``never``), or ``unavailable`` where there is no such setting."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def can_advise() -> bool:
    """Whether this platform can ask for huge pages on an anonymous mapping."""
    return all(hasattr(mmap, name) for name in ("MADV_HUGEPAGE", "MAP_PRIVATE", "MAP_ANONYMOUS"))


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` in a private anonymous mapping advised MADV_HUGEPAGE
    before it is touched (``torch.zeros`` where the platform cannot advise).
    The tensor holds the mapping: it is unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not can_advise() or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: 4 KiB pages, as torch.zeros
        pass
    out = torch.frombuffer(region, dtype=dtype).view(shape)  # keeps `region` alive
    out.zero_()  # fault every page in now, not in the first steps that write there
    return out


def backed_bytes(t: torch.Tensor, smaps: Path = SMAPS) -> int:
    """Bytes of ``t``'s storage that huge pages back now (AnonHugePages of
    the mappings it spans); 0 where smaps cannot be read."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: lo-hi perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
