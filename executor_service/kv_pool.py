"""The physical KV pool of one executor, and its CPU swap pool.

Vocabulary (the memory service owns the *numbers*, this module the *bytes*):
  kv      [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          on the device; ``kv[l, 0]`` / ``kv[l, 1]`` are layer l's K / V
          caches in the kernels' layout ``[NB, BS, KVH, D]``.
          Stored head-major within a block (``[..., NB, KVH, BS, D]`` in
          memory, the shape above a transposed view): one kv head's rows of
          a block are contiguous (4 KiB at 16 tokens x 64 dims in fp32), so
          decode attention streams them whole instead of every other 256
          bytes (``head_major``). Every kernel takes the caches by strides.
          On CPU it is advised for transparent huge pages (``huge_pages``):
          the walk over a scattered table took a page walk per block.
  swap    the same shape and storage with ``num_swap_blocks`` blocks, in CPU
          memory (pinned when CUDA is available, so swaps are DMA copies).
  slot    block_id * block_size + offset, the same arithmetic everywhere.

Every cache op moves whole blocks of all layers at once (one index_select /
index_copy_ or one kernel launch per op kind, never a loop over blocks).
"""

from __future__ import annotations

import torch

from executor_service.attention import KernelBackend
from executor_service.huge_pages import backed_bytes, huge_zeros

GIB = 1 << 30


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_bytes(budget_bytes: int, per_block_bytes: int) -> int:
    return max(0, int(budget_bytes) // per_block_bytes)


def device_pool_budget(device: torch.device, gpu_memory_fraction: float) -> int:
    """Bytes the device pool may take on CUDA: fraction of total minus in use.

    Call after the model is loaded, so its weights (and the allocator's
    reserve) are counted as in use.
    """
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * gpu_memory_fraction) - used


def head_major(shape: tuple[int, ...], huge: bool = False, **kw) -> torch.Tensor:
    """Zeros of logical ``shape`` [..., NB, BS, KVH, D], stored as [..., NB,
    KVH, BS, D]. With the token-major storage a kv head's rows of a block sat
    every other 256 bytes; a cold fp32 decode of the 0.5B Llama's shapes (32
    sequences, 24 layers' K/V read in turn) took 621 against 693 us a layer
    head-major, interleaved in one process (docs/benchmarks.md); bf16 level.
    ``huge``: in CPU memory on transparent huge pages (huge_pages.py; ``kw``
    then names the ``dtype`` and no device but the CPU)."""
    *outer, bs, kvh, d = shape
    stored = (*outer, kvh, bs, d)
    if not huge:
        return torch.zeros(stored, **kw).transpose(-3, -2)
    if torch.device(kw.get("device", "cpu")).type != "cpu" or kw.get("pin_memory"):
        raise ValueError("huge pages are for an unpinned CPU pool")
    t = huge_zeros(stored, kw["dtype"])
    return t.transpose(-3, -2)


class KvPool:
    """Owns the device pool tensor and the CPU swap pool tensor."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_swap_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: KernelBackend,
        huge_pages: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_swap_blocks = num_swap_blocks
        self.dtype = dtype
        self.device = device
        self.backend = backend
        # Zeroed: attention gathers whole blocks and masks the tail, and a
        # masked NaN from uninitialised memory would still poison the output.
        # In CPU memory on huge pages unless told not to: a decode walks every layer's blocks (huge_pages.py).
        self.kv = head_major(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            huge=huge_pages and device.type == "cpu", dtype=dtype, device=device,
        )
        pin = device.type == "cuda"
        self.swap = head_major(
            (num_layers, 2, num_swap_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device="cpu",
            pin_memory=pin,
        )
        self.block_bytes = block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def kv_pool_huge_bytes(self) -> int:
        """Bytes of the device pool huge pages back (0 on CUDA, or where the
        kernel gave none: ``huge_pages.backed_bytes``)."""
        return backed_bytes(self.kv) if self.kv.device.type == "cpu" else 0

    @property
    def swap_pool_bytes(self) -> int:
        return self.swap.numel() * self.swap.element_size()

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k_cache, v_cache) views, each [NB, BS, KVH, D]."""
        return [(self.kv[layer, 0], self.kv[layer, 1]) for layer in range(self.num_layers)]

    def swap_out(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Device blocks src[i] -> swap blocks dst[i]. src, dst: [P] int64 (CPU)."""
        if src.numel() == 0:
            return
        moved = self.kv.index_select(2, src.to(self.device)).to("cpu")  # [L, 2, P, BS, KVH, D]
        self.swap.index_copy_(2, dst.cpu(), moved)

    def swap_in(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Swap blocks src[i] -> device blocks dst[i]. src, dst: [P] int64 (CPU)."""
        if src.numel() == 0:
            return
        moved = self.swap.index_select(2, src.cpu()).to(self.device, non_blocking=True)
        self.kv.index_copy_(2, dst.to(self.device), moved)

    def swap_round_trip(self, num_blocks: int = 8) -> int:
        """Swap the first num_blocks out and back in (a bandwidth probe of the
        still empty pool: nothing it holds changes). Returns the blocks moved
        (out and in summed); the caller times it, synchronising the device."""
        n = min(num_blocks, self.num_blocks, self.num_swap_blocks)
        ids = torch.arange(n, dtype=torch.int64)
        self.swap_out(ids, ids)
        self.swap_in(ids, ids)
        return 2 * n

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Device blocks src[i] -> dst[i] (copy-on-write), all layers, K and V."""
        if src.numel() == 0:
            return
        src = src.to(self.device)
        dst = dst.to(self.device)
        if self.device.type == "cuda":
            self.backend.copy_blocks_all_layers(self.kv, src, dst)
        else:  # index_copy_ reads the gathered source first, so any src/dst mix is safe
            self.kv.index_copy_(2, dst, self.kv.index_select(2, src))
