"""CUDA graphs for decode steps: captured once per batch size, replayed per step.

On a GPU a decode forward is several hundred small kernels (about fifteen a
layer), and at small batches launching them from Python costs more than
running them. ``DecodeGraphs`` captures the model's forward for decode-only
batches of a fixed ladder of sizes (``graph_batch_sizes``: 1, 2, 4, 8, 16,
24, … up to the largest) over static input buffers. A step of S decodes
copies its inputs into the first S rows of the smallest captured size B ≥ S,
turns rows S..B into padding (slot -1: they write no K/V; a context of one
token: they attend to a real, finite key), replays the graph and keeps its S
rows of logits. Prefill, mixed steps and batches larger than the largest
graph run eagerly; so does everything off CUDA, where there is nothing to
capture.

Static buffers (B_max rows; MB = the blocks of a longest sequence):
  input_ids [B_max] int64, positions [B_max] int64, seq_lens [B_max] int32,
  query_start_loc [B_max + 1] int32 = 0..B_max (one query token a row),
  logits_indices [B_max] int64 = 0..B_max - 1,
  per table group: slot_mappings [B_max] int32, block_tables [B_max, MB] int32.
A table is copied into its first columns only: the kernels read a row's
entries below its seq_len and no further, so the stale columns beyond are
never touched (and stale entries are block ids an earlier step checked).

The graphs hold the addresses of the KV pool's tensors and of these buffers;
an executor allocates its pool once, so they stay valid for its life. All
sizes share one memory pool, captured largest first, as their forwards never
overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from executor_service.model_runner import ForwardBatch
from kvpager.telemetry import get_logger

if TYPE_CHECKING:
    from executor_service.attention import KernelBackend
    from executor_service.model_runner import ModelRunner

log = get_logger(__name__)

PAD_SLOT = -1  # store_kv skips negative slots


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The sizes captured: 1, 2, 4, then every multiple of 8 up to
    ``max_batch`` (which is always included). A step pads to the next size,
    so padding wastes at most 7 rows past 8."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def graphs_apply(device: torch.device, backend_name: str, model_impl: str, enforce_eager: bool,
                 interpreted: bool = False) -> str | None:
    """Why decode steps run eagerly here, or None when they are captured.

    Graphs need CUDA, the Triton backend (its launchers take shapes only,
    never a value off the device, so a capture records every launch), and
    our own forward (transformers' model code builds masks and caches per
    call). ``interpreted``: Triton runs its interpreter (TRITON_INTERPRET=1),
    which copies every argument through the host."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return f"device {device.type}"
    if backend_name != "triton":
        return f"attention backend {backend_name}"
    if interpreted:
        return "triton interpreter (TRITON_INTERPRET=1)"
    if model_impl != "kvpager":
        return f"model_impl {model_impl}"
    return None


def triton_interpreted() -> bool:
    from kvpager_kernels._jit import is_interpreted
    from kvpager_kernels.triton_store_kv import _store_kv_kernel

    return is_interpreted(_store_kv_kernel)


class CudaGraph:
    """One captured forward: ``capture(fn)`` records fn's kernels and returns
    its output tensor, which every ``replay()`` rewrites in place."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], CudaGraph]:
    """New graphs sharing one memory pool."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class DecodeGraphs:
    """The captured decode forwards of one model over one KV pool.

    ``fits(batch)`` says whether a step can replay a graph; ``replay(batch)``
    then stands in for ``ModelRunner.forward``; the caller runs the rest
    eagerly. ``new_graph``: makes an object with ``capture(fn)`` and
    ``replay()`` (``cuda_graph_factory()`` on CUDA).
    """

    def __init__(self, runner: ModelRunner, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: KernelBackend, layer_groups: tuple[int, ...] | None, *, num_groups: int,
                 max_blocks_per_seq: int, max_batch: int, new_graph: Callable[[], object],
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        self.runner, self.kv_caches, self.backend, self.layer_groups = runner, kv_caches, backend, layer_groups
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        device = kv_caches[0][0].device
        b, mb = self.max_batch, max_blocks_per_seq
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(b, dtype=torch.int64, device=device)
        self.slot_mappings = [torch.full((b,), PAD_SLOT, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.block_tables = [torch.zeros((b, mb), dtype=torch.int32, device=device) for _ in range(num_groups)]
        self._graphs: dict[int, object] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> its graph's logits [size, V] fp32
        t0 = time.perf_counter()
        # Largest first: the smaller graphs reuse the shared pool's memory.
        for i, size in enumerate(reversed(self.sizes)):
            self._capture(size, new_graph())
            if on_progress is not None:
                on_progress(i + 1, len(self.sizes))
        self.capture_s = time.perf_counter() - t0

    def _batch(self, size: int) -> ForwardBatch:
        """The static buffers' first ``size`` rows as a forward's inputs (views, no copies)."""
        tables = [t[:size] for t in self.block_tables]
        slots = [s[:size] for s in self.slot_mappings]
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=slots[0],
            block_tables=tables[0], seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            logits_indices=self.logits_indices[:size], group_block_tables=tables, group_slot_mappings=slots,
        )

    def _run(self, size: int) -> torch.Tensor:
        return self.runner.forward(self._batch(size), self.kv_caches, self.backend, self.layer_groups)

    def _capture(self, size: int, graph) -> None:
        # Every row is padding now (slot -1, one token of context): the
        # warm-up forward writes nothing into the pool. It compiles the
        # Triton kernels for this size and sets up the BLAS handles, neither
        # of which may happen during a capture.
        self._pad(0)
        self._run(size)
        self._outputs[size] = graph.capture(lambda: self._run(size))
        self._graphs[size] = graph

    def _pad(self, start: int) -> None:
        """Rows ``start`` and on: padding that writes no K/V and attends to one key."""
        self.positions[start:].zero_()
        self.seq_lens[start:].fill_(1)
        for slots in self.slot_mappings:
            slots[start:].fill_(PAD_SLOT)

    def fits(self, batch: ForwardBatch) -> bool:
        """Decode-only (one token a row), no larger than the largest graph,
        tables no wider than the buffers; shapes only, no device sync."""
        num_seqs = batch.seq_lens.shape[0]
        return (0 < num_seqs <= self.max_batch and batch.input_ids.shape[0] == num_seqs
                and all(batch.tables_of(g).shape[1] <= self.max_blocks_per_seq
                        for g in range(len(self.block_tables))))

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured size holding ``num_seqs`` rows."""
        return next(s for s in self.sizes if s >= num_seqs)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """``ModelRunner.forward`` for a batch that ``fits``: writes its K/V
        into the pool and returns logits [R, V] fp32 for ``batch.logits_indices``."""
        if not self.fits(batch):
            raise ValueError("replay needs a decode-only batch that fits a captured size (check fits first)")
        n = batch.seq_lens.shape[0]
        size = self.size_for(n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        for g, (tables, slots) in enumerate(zip(self.block_tables, self.slot_mappings)):
            src = batch.tables_of(g)
            tables[:n, :src.shape[1]].copy_(src)
            slots[:n].copy_(batch.slots_of(g))
        if size > n:
            self._pad(n)
        self._graphs[size].replay()
        # A copy: the next replay rewrites the graph's output.
        return self._outputs[size].index_select(0, batch.logits_indices)


def capture_decode_graphs(runner: ModelRunner, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                          backend: KernelBackend, layer_groups: tuple[int, ...] | None, *, num_groups: int,
                          max_model_len: int, block_size: int, max_batch: int,
                          enforce_eager: bool) -> DecodeGraphs | None:
    """An executor's decode graphs, or None (logged why) where steps run eagerly."""
    why = graphs_apply(runner.device, backend.name, runner.model_impl, enforce_eager,
                       interpreted=backend.name == "triton" and triton_interpreted())
    if why is not None:
        log.info("decode steps run eagerly (no CUDA graphs)", reason=why)
        return None

    def progress(done: int, total: int) -> None:
        if done % 8 == 0 or done == total:
            log.info("capturing decode CUDA graphs", done=done, total=total)

    try:
        graphs = DecodeGraphs(runner, kv_caches, backend, layer_groups, num_groups=num_groups,
                              max_blocks_per_seq=-(-max_model_len // block_size), max_batch=max_batch,
                              new_graph=cuda_graph_factory(), on_progress=progress)
    except torch.OutOfMemoryError as exc:
        # The pool took its share first; serving without graphs beats not serving.
        torch.cuda.empty_cache()
        log.warning("no memory left for decode CUDA graphs; steps run eagerly (lower --gpu-memory-fraction "
                    "or --cuda-graph-max-batch to keep them)", error=str(exc)[:200])
        return None
    sizes = graphs.sizes
    log.info("decode CUDA graphs captured", sizes=f"{sizes[0]}..{sizes[-1]} ({len(sizes)})",
             capture_s=round(graphs.capture_s, 2))
    return graphs
