"""The executor: one model, one KV pool, one step at a time.

``Executor(config)`` loads the checkpoint, sizes and allocates the pool, and
then runs ``execute(step)``: validate (nothing is touched on a bad step),
apply cache ops (swap-out, swap-in, copy), forward, sample. It knows nothing
about policy and never imports grpc; errors are ``kvpager.errors`` types.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import torch

from executor_service import burst, metrics, sizing
from executor_service.attention import load_backend
from executor_service.carry import Carry, answer, merge
from executor_service.config import ExecutorConfig
from executor_service.costs import CostMeter
from executor_service.cuda_graphs import capture_decode_graphs
from executor_service.history import TokenHistories
from executor_service.info import ExecutorInfo
from executor_service.placeholders import LastSamples
from executor_service.cpu import CoreBinding, ThreadTuner, allowed_cores, bind_team_op, thread_candidates
from executor_service.cpu_allocator import keep_freed_memory
from executor_service.greedy import greedy_only, greedy_tokens
from executor_service.kv_layout import make_layout, pool_tokens
from executor_service.kv_pool import GIB, KvPool, block_bytes, num_blocks_for_bytes
from executor_service.model_runner import ModelRunner, resolve_device
from executor_service.models import ForwardStopped
from executor_service.sampler import sample
from executor_service.step import (PoolLimits, StepInput, StepOutput, build_forward_batch, build_sampling_inputs,
                                   check_step)
from executor_service.tables import BlockTables, Resolved, TableChanges
from executor_service.write_log import WriteLog
from kvpager.errors import InvalidArgument, ResourceExhausted
from kvpager.telemetry import get_logger

log = get_logger(__name__)

SWAP_DEFAULT_MAX_BYTES = 4 * GIB


def new_incarnation() -> int:
    """A fresh non-zero 63-bit number per process start (0 means 'unchecked')."""
    return secrets.randbits(63) or 1


def _backend_name(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "triton"
    from kvpager_kernels import cpu_attention

    return "cpu" if cpu_attention.available() else "torch"


class Executor:
    """Holds the model and the pool; ``execute`` is thread-safe (serialised)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        keep_freed_memory()
        on_cpu = resolve_device(config.device).type == "cpu"
        self.threads = ThreadTuner(thread_candidates() if on_cpu else (torch.get_num_threads(),))
        bind = on_cpu and config.cpu_bind
        self.cores = CoreBinding(allowed_cores(), bind, bind_team_op() if bind else None)
        # Load on one OpenMP thread. Servers build the executor on a loader
        # thread and run steps on another; had both started a team of OpenMP
        # workers, libgomp would manage more threads than there are cores and
        # switch every team to short spins, so each of a step's ~500 parallel
        # regions would pay a futex wake-up. Measured: a 32-sequence decode
        # step of the 30M Llama on 2 threads took 31-39 ms (min) run from a
        # worker thread after a 2-thread load, 23-26 ms after a 1-thread load,
        # 23 ms on the loading thread itself. (The count is per thread: the
        # caller's own setting is restored below.)
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._load(config)
        finally:
            torch.set_num_threads(previous)

    def _load(self, config: ExecutorConfig) -> None:
        self.runner = ModelRunner(config.model, device=config.device, dtype=config.dtype,
                                  model_impl=config.model_impl)
        self.device = self.runner.device
        self.backend = load_backend(_backend_name(config.attention_backend, self.device))
        if self.backend.name == "triton" and self.device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("the triton backend on CPU needs TRITON_INTERPRET=1 (tests only)")
        self.max_model_len = sizing.asked_model_len(self.runner.max_model_len, config.max_model_len)
        # Which pool slot and table group each layer uses (kv_layout.py): a block holds num_slots layers.
        self.layout = make_layout(config.kv_layout, self.runner.layer_windows)
        per_block = block_bytes(
            self.layout.num_slots, config.block_size, self.runner.num_kv_heads, self.runner.head_dim, self.runner.dtype
        )
        num_blocks = sizing.pool_num_blocks(config, self.device, per_block)
        num_swap = config.swap_blocks
        if num_swap is None:
            num_swap = min(num_blocks // 2, num_blocks_for_bytes(SWAP_DEFAULT_MAX_BYTES, per_block))
        try:
            self.pool = KvPool(
                num_layers=self.layout.num_slots,
                num_blocks=num_blocks,
                block_size=config.block_size,
                num_kv_heads=self.runner.num_kv_heads,
                head_dim=self.runner.head_dim,
                num_swap_blocks=num_swap,
                dtype=self.runner.dtype,
                device=self.device,
                backend=self.backend,
                huge_pages=config.huge_pages,
            )
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            raise ResourceExhausted(f"cannot allocate a KV pool of {num_blocks} blocks: {exc}") from exc
        slots = self.pool.layer_caches()
        self._kv_caches = [slots[s] for s in self.layout.layer_slot]  # per layer: its slot's (k, v) views
        # Its own prefill throughput and copy bandwidth, reported to the memory service (costs.py).
        self.costs = CostMeter(self.pool.block_bytes)
        self._probe_swap()
        self.max_model_len = sizing.fit_model_len(self.max_model_len, config.max_model_len,
                                                  pool_tokens(self.layout, num_blocks, config.block_size))
        self.executor_id = config.executor_id
        self.model_id = config.model_id or Path(config.model).resolve().name
        self.incarnation = new_incarnation()
        self.pool_generation = 1
        self.last_step_id = 0  # step_id of the last Execute this pool applied (ConfirmPool; 0 = none)
        self.write_log = WriteLog(self.pool.block_size)  # blocks recent steps wrote (ConfirmPool)
        # The running sequences' block tables: kept here, changed by each plan (docs/executor.md).
        self.tables = BlockTables(num_blocks, config.block_size, self.max_model_len,
                                  window=self.layout.groups[0].window)
        # The hybrid layout's other table groups (a sliding group's tables may hold holes).
        self.group_tables = [BlockTables(num_blocks, config.block_size, self.max_model_len, window=g.window)
                             for g in self.layout.groups[1:]]
        self._layer_groups = self.layout.layer_group if self.group_tables else None
        # The penalised sequences' tokens, following the same plans (history.py).
        self.histories = TokenHistories()
        # Its last step's one-token samples: the next step's placeholder tokens (placeholders.py).
        self.last_samples = LastSamples()
        self._limits = PoolLimits(
            num_blocks=num_blocks,
            num_swap_blocks=num_swap,
            block_size=config.block_size,
            vocab_size=self.runner.vocab_size,
            max_model_len=self.max_model_len,
            incarnation=self.incarnation,
        )
        self._lock = threading.Lock()
        self._cut_step = 0  # a decode burst to cut short after its current sub-step (request_cut)
        self._carry: Carry | None = None  # the next sub-step of the burst cut last, for the step that cut it
        # Last: the graphs capture forwards over the finished pool (cuda_graphs.py).
        self.graphs = capture_decode_graphs(
            self.runner, self._kv_caches, self.backend, self._layer_groups, num_groups=1 + len(self.group_tables),
            max_model_len=self.max_model_len, block_size=config.block_size, max_batch=config.cuda_graph_max_batch,
            enforce_eager=config.enforce_eager)
        labels = (self.executor_id,)
        metrics.CUDA_GRAPHS.labels(*labels).set(len(self.graphs.sizes) if self.graphs else 0)
        metrics.POOL_BYTES.labels(*labels, "device").set(self.pool.kv_pool_bytes)
        metrics.POOL_BYTES.labels(*labels, "swap").set(self.pool.swap_pool_bytes)
        self.kv_pool_huge_bytes = self.pool.kv_pool_huge_bytes()  # read once: ~70 ms of smaps with a 0.5B model
        metrics.POOL_HUGE_BYTES.labels(*labels).set(self.kv_pool_huge_bytes)
        metrics.POOL_BLOCKS.labels(*labels, "device").set(num_blocks)
        metrics.POOL_BLOCKS.labels(*labels, "swap").set(num_swap)

    def _probe_swap(self) -> None:
        """The copy bandwidth before the first preemption (later swaps refine it)."""
        for _ in range(3 if self.pool.num_swap_blocks else 0):
            t0 = time.perf_counter()
            moved = self.pool.swap_round_trip()
            self._sync()
            self.costs.record_swap(moved, time.perf_counter() - t0)

    @property
    def limits(self) -> PoolLimits:
        return self._limits

    def info(self) -> ExecutorInfo:
        r = self.runner
        return ExecutorInfo(
            executor_id=self.executor_id,
            model_id=self.model_id,
            model_type=r.model_type,
            vocab_size=r.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(r.eos_token_ids),
            num_layers=r.num_layers,
            num_kv_heads=r.num_kv_heads,
            head_dim=r.head_dim,
            dtype=str(r.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=self.backend.name,
            model_impl=r.model_impl,
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            num_swap_blocks=self.pool.num_swap_blocks,
            incarnation=self.incarnation,
            pool_generation=self.pool_generation,
            kv_pool_bytes=self.pool.kv_pool_bytes,
            kv_layout=self.layout.name,
            kv_groups=[(g.window or 0, g.layers) for g in self.layout.groups],
        )

    def confirm_pool(self, incarnation: int, pool_generation: int) -> bool:
        """True iff the caller's (incarnation, generation) is this pool's."""
        return incarnation == self.incarnation and pool_generation == self.pool_generation

    def confirm_with_writes(self, incarnation: int, pool_generation: int, since_step: int):
        """(confirmed, last applied step id, device blocks written by steps
        after since_step — None when the log no longer reaches back or nothing
        was asked). Lock-free, so a running step does not delay a recovering
        memory service: steps record themselves before touching the pool, so
        reading the step id first and the log second can only over-report
        writes; a generation change in between (a failed step) is a refusal."""
        generation = self.pool_generation
        last = self.last_step_id
        written = self.write_log.written_since(since_step) if since_step and last > since_step else None
        confirmed = (self.confirm_pool(incarnation, pool_generation) and generation == self.pool_generation)
        return confirmed, last, written

    def request_cut(self, step_id: int) -> None:
        """Cut the decode burst ``step_id`` short (between sub-steps, or before a
        later sub-step's next layer: burst.run), a step waits behind it. From any
        thread; a step that is not a running burst ignores it. An executor with a
        table per KV group never cuts (a window may pass the slots a cut gives back)."""
        if not self.group_tables:
            self._cut_step = step_id

    def execute(self, step: StepInput, on_part: burst.OnPart | None = None) -> StepOutput:
        """Run one step. Raises InvalidArgument / FailedPrecondition before
        touching anything (but a step refused when it should carry the next
        sub-step of the burst it cut voids every table: ``_invalidate``),
        ResourceExhausted when memory runs out. ``on_part``: a decode burst's
        sub-steps as they end (``burst.run``), on this thread."""
        carry, self._carry = self._carry, None  # a cut burst's next sub-step, for the step that cut it
        with self._lock:
            try:
                step = check_step(step, self._limits)
                if step.decode_steps > 1:
                    burst.check_burst(step)
                if carry is not None and (step.prev_step_id != carry.step_id or step.decode_steps > 1):
                    raise InvalidArgument(f"step {step.step_id} follows step {step.prev_step_id}, but step "
                                          f"{carry.step_id} was cut short for the step that cut it (cut_prev)")
                step = self.last_samples.fill(step)
                resolved = self.tables.resolve(step.table_epoch, step.tables, step.seq_ids, step.query_lens,
                                               step.context_lens)
                extra = self._resolve_groups(step)
                histories = self.histories.resolve(step, resolved)
            except Exception:
                if carry is not None:  # refused: the token its tables count as computed never will be
                    self._invalidate()
                raise
            # Recorded before anything is touched: a ConfirmPool racing this step sees it.
            self.last_step_id = step.step_id
            written = (resolved.slot_mapping if not extra
                       else np.concatenate([resolved.slot_mapping] + [r.slot_mapping for r in extra]))
            self.write_log.record(step.step_id, written, step.cache_ops.copy_dst, step.cache_ops.swap_in_dst)
            self.tables.commit(resolved, step.seq_ids, step.query_lens)
            for tables, r in zip(self.group_tables, extra):
                tables.commit(r, step.seq_ids, step.query_lens)
            self.histories.commit(histories)
            try:
                if step.decode_steps > 1:  # one-token forwards back to back (executor_service.burst)
                    out, self._carry = burst.run(step, [resolved, *extra], histories.rows, self._run, on_part,
                                                 lambda: self._cut_step == step.step_id)
                    if out.sub_steps_run:  # cut short: the sub-steps not run (nor carried) computed nothing
                        self.tables.uncompute(step.seq_ids, step.query_lens - burst.computed_lens(step, out))
                        metrics.BURSTS_CUT.labels(self.executor_id).inc()
                elif carry is not None:  # the burst this step cut runs its next sub-step here (carry.py)
                    step, merged, kept = merge(step, resolved, carry)
                    out = self._run(step, merged, histories.rows, extra)
                    metrics.SUB_STEPS_CARRIED.labels(self.executor_id).inc()
                else:
                    out = self._run(step, resolved, histories.rows, extra)
                self.last_samples.record(step, out)
                if carry is not None:
                    out = answer(out, kept)  # a sample for every carried row, in the burst's row order
                if self._cut_step == step.step_id:
                    self._cut_step = 0  # heard (or too late): ids restart with another gateway
                return out
            except Exception as exc:
                self._invalidate()  # the pool may hold half-applied moves now
                if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
                    metrics.FAILED_STEPS.labels(self.executor_id, "error").inc()
                    raise
                metrics.FAILED_STEPS.labels(self.executor_id, "oom").inc()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                raise ResourceExhausted(f"out of memory in step {step.step_id}: {exc}", retry_after_s=1.0) from exc

    def _invalidate(self) -> None:
        """Forget every table and what the memory service remembers of the pool
        (a new generation): after a failed step, or a dropped carried sub-step."""
        self._carry = None
        self.pool_generation += 1
        self.last_step_id = 0  # a new generation has applied nothing yet
        self.write_log.reset()
        self.tables.clear()
        for tables in self.group_tables:
            tables.clear()
        self.histories.clear()
        self.last_samples.clear()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _resolve_groups(self, step: StepInput) -> list[Resolved]:
        """The hybrid layout's other table groups, resolved like group 0 (their
        starts and extends; group 0's forks and drops)."""
        if len(step.group_tables) != len(self.group_tables):
            raise InvalidArgument(f"plan.group_tables: this executor's KV layout has {len(self.group_tables)} "
                                  f"more table groups, the plan carries {len(step.group_tables)}")
        out = []
        for tables, changes in zip(self.group_tables, step.group_tables):
            merged = TableChanges(step.tables.forks, step.tables.dropped, changes.started_seq_ids,
                                  changes.started_context_lens, changes.started_offsets, changes.started_block_ids,
                                  changes.extended_seq_ids, changes.extended_first_index, changes.extended_offsets,
                                  changes.extended_block_ids)
            out.append(tables.resolve(step.table_epoch, merged, step.seq_ids, step.query_lens, step.context_lens))
        return out

    def _run(self, step: StepInput, resolved: Resolved, histories: dict, extra: list[Resolved],
             stop=None) -> StepOutput:
        """One forward and its sampling. ``stop``: asked before each layer (a burst's later sub-steps, burst.run)."""
        ops = step.cache_ops
        t0 = time.perf_counter()
        if ops.num_ops:
            self._apply_cache_ops(step)
            self._sync()
        t1 = time.perf_counter()
        n = len(step.seq_ids)
        num_tokens = len(step.token_ids)
        threads = self.threads.choose(num_tokens)
        self.cores.use(threads)
        sampling = step.sampling
        if num_tokens:
            batch = build_forward_batch(step, resolved, self.device, [resolved, *extra] if extra else None)
            batch.stop = stop
            graphed = self.graphs is not None and self.graphs.fits(batch)
            try:
                logits = (self.graphs.replay(batch) if graphed else
                          self.runner.forward(batch, self._kv_caches, self.backend, self._layer_groups))  # [R, V]
            except ForwardStopped:
                metrics.FORWARDS.labels(self.executor_id, "stopped").inc()
                raise
            self._sync()
            metrics.FORWARDS.labels(self.executor_id, "graph" if graphed else "eager").inc()
        t2 = time.perf_counter()
        top_counts = np.zeros(n, np.int64)
        logprobs = np.zeros(0, np.float32) if sampling.return_logprobs else None
        top_ids, top_lps = np.zeros(0, np.int32), np.zeros(0, np.float32)
        if num_tokens and len(batch.logits_indices) and greedy_only(sampling, n):
            token_ids = greedy_tokens(logits)  # one row of logits per row: each samples
        elif num_tokens and len(batch.logits_indices):
            rows = np.nonzero((sampling.num_samples > 0) | (sampling.num_top_logprobs > 0))[0]
            out = sample(logits, build_sampling_inputs(step, resolved, self.device, histories))
            token_ids = out.token_ids.to(torch.int32).cpu().numpy()
            logprobs = out.logprobs.cpu().numpy().astype(np.float32) if out.logprobs is not None else None
            top_counts[rows] = out.top_counts.cpu().numpy()
            top_ids = out.top_token_ids.to(torch.int32).cpu().numpy()
            top_lps = out.top_logprobs.float().cpu().numpy()
        else:
            token_ids = np.zeros(0, np.int32)
        t3 = time.perf_counter()
        self.threads.record(num_tokens, threads, t3 - t1)
        self.costs.record_forward(num_tokens, t2 - t1)
        top_offsets = np.zeros(n + 1, np.int32)
        np.cumsum(top_counts, out=top_offsets[1:])

        labels = (self.executor_id,)
        metrics.STEPS.labels(*labels).inc()
        metrics.STEP_THREADS.labels(self.executor_id, str(threads)).inc()
        metrics.THREADS_BOUND.labels(self.executor_id).set(self.cores.bound)
        metrics.TOKENS_COMPUTED.labels(*labels).inc(num_tokens)
        metrics.TOKENS_SAMPLED.labels(*labels).inc(len(token_ids))
        metrics.FORWARD_SECONDS.labels(*labels).observe(t2 - t1)
        metrics.SAMPLE_SECONDS.labels(*labels).observe(t3 - t2)
        return StepOutput(
            step_id=step.step_id,
            sampled_token_ids=token_ids,
            sampled_logprobs=logprobs,
            top_offsets=top_offsets,
            top_token_ids=top_ids,
            top_logprobs=top_lps,
            forward_s=t2 - t1,
            sample_s=t3 - t2,
            cache_ops_s=t1 - t0,
        )

    def _apply_cache_ops(self, step: StepInput) -> None:
        """Swap-out, then swap-in, then copies: a block swapped out may be
        reused as a swap-in or copy destination in the same step."""
        ops = step.cache_ops

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

        num_swapped = len(ops.swap_out_src) + len(ops.swap_in_src)
        t0 = time.perf_counter()
        self.pool.swap_out(t(ops.swap_out_src), t(ops.swap_out_dst))
        self.pool.swap_in(t(ops.swap_in_src), t(ops.swap_in_dst))
        if num_swapped:
            self._sync()
            self.costs.record_swap(num_swapped, time.perf_counter() - t0)
        self.pool.copy(t(ops.copy_src), t(ops.copy_dst))
        for name, arr in (("swap_out", ops.swap_out_src), ("swap_in", ops.swap_in_src), ("copy", ops.copy_src)):
            if len(arr):
                metrics.CACHE_OPS.labels(self.executor_id, name).inc(len(arr))
