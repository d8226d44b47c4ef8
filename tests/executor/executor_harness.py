"""Shared helpers of the executor tests (fixtures live in conftest.py).

* ``Plan`` is a tiny stand-in for the memory service: a block allocator with
  refcounts and a step builder that sends, from per-sequence state, what the
  executor's tables need: a start (whole table, tokens in cache) for a
  sequence it does not hold as the test now has it, an extend when only the
  table grew or its tail was replaced, a fork op, drops.
* ``LoopThread`` runs the session's gRPC servers on one background loop.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from kvpager import packed
from kvpager.v1 import common_pb2, executor_pb2, executor_pb2_grpc

BLOCK_SIZE = 4
NUM_BLOCKS = 96
SWAP_BLOCKS = 24

CHECKPOINTS = {
    "llama_mha": dict(arch="llama", num_heads=4, num_kv_heads=4, seed=1),
    "llama_gqa": dict(arch="llama", num_heads=4, num_kv_heads=2, seed=2),
    "qwen2": dict(arch="qwen2", num_heads=4, num_kv_heads=2, seed=3),
    # Sliding windows of WINDOW tokens: every layer (Mistral), the upper layers
    # from max_window_layers (Qwen2: layer 0 full, 1-2 sliding), alternating
    # local / global with soft-capping (Gemma 2: 0 and 2 sliding).
    "mistral_swa": dict(arch="mistral", num_heads=4, num_kv_heads=2, seed=4, sliding_window=16),
    "qwen2_swa": dict(arch="qwen2", num_heads=4, num_kv_heads=2, seed=5, sliding_window=16, num_layers=3,
                      max_window_layers=1),
    "gemma2": dict(arch="gemma2", num_heads=4, num_kv_heads=2, seed=6, sliding_window=16, num_layers=3),
    "gemma3": dict(arch="gemma3", num_heads=4, num_kv_heads=2, seed=7, sliding_window=16, num_layers=3),
}
WINDOW = 16


def triton_available() -> bool:
    try:
        import kvpager_kernels as kernels

        kernels.paged_attention  # noqa: B018 - resolving imports the launcher
        kernels.store_kv  # noqa: B018
        return True
    except Exception:  # noqa: BLE001 - not written yet / no triton
        return False


class LoopThread:
    """An asyncio loop on a daemon thread; servers live here for the session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="executor-tests-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Served:
    server: object
    executor: object
    channel: object
    stub: executor_pb2_grpc.ExecutorServiceStub
    info: executor_pb2.ExecutorInfo
    checkpoint: str


# ---------------------------------------------------------------- plans


class Allocator:
    """Refcounted block ids. Freed blocks are reused first (LIFO), so tests
    overwrite just-freed KV and catch any read of stale blocks."""

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        self.free = list(range(first, num_blocks))
        self.refs: dict[int, int] = {}

    def alloc(self) -> int:
        block = self.free.pop(0)
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.insert(0, b)


@dataclass
class Seq:
    seq_id: int
    tokens: list[int]                 # prompt + generated so far
    num_computed: int = 0             # tokens whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    prompt_len: int = 0
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Plan:
    """Builds ExecuteRequests from per-sequence state and applies results."""

    def __init__(self, served: Served, block_size: int = BLOCK_SIZE) -> None:
        import random

        self.served = served
        # A Plan is one memory-service registration of the pool: its own epoch voids
        # the tables an earlier Plan (test) left in this (shared) executor.
        self.epoch = random.getrandbits(62) + 1
        self.block_size = block_size
        self.alloc = Allocator(served.info.num_blocks)
        self.step_id = 0
        self._next_seq = 1
        # What the executor holds, as of the last successful step: seq_id -> (table, computed).
        self.sent: dict[int, tuple[list[int], int]] = {}
        self._drops: list[int] = []
        self._forks: list[tuple[int, list[int]]] = []

    def new_seq(self, prompt: list[int], **kw) -> Seq:
        seq = Seq(self._next_seq, list(prompt), **kw)
        self._next_seq += 1
        return seq

    def ensure_blocks(self, seq: Seq, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        while len(seq.blocks) < need:
            seq.blocks.append(self.alloc.alloc())

    def fork(self, parent: Seq, child: Seq) -> None:
        """child shares every block of parent (refcount++), as the memory service's fork;
        the executor is told with a fork op in the next request."""
        child.blocks = list(parent.blocks)
        for blk in child.blocks:
            self.alloc.share(blk)
        child.num_computed = parent.num_computed
        self._forks.append((parent.seq_id, [child.seq_id]))

    def table_changes(self, items) -> common_pb2.TableChanges:
        """Forks and drops so far, then per item a start (the executor does not
        hold the sequence as it is now) or an extend (its table changed)."""
        sent = dict(self.sent)
        for parent, children in self._forks:
            for child in children:
                if parent in sent:
                    sent[child] = sent[parent]
        for seq_id in self._drops:
            sent.pop(seq_id, None)
        started = ([], [], [0], [])   # ids, context lens, offsets, blocks
        extended = ([], [], [0], [])  # ids, first index, offsets, blocks
        for seq, _ in items:
            have = sent.get(seq.seq_id)
            if have is None or have[1] != seq.num_computed:
                ids, ctx, offs, blocks = started
                ids.append(seq.seq_id)
                ctx.append(seq.num_computed)
                blocks.extend(seq.blocks)
                offs.append(len(blocks))
            elif have[0] != seq.blocks:
                first = next((i for i, (a, b) in enumerate(zip(have[0], seq.blocks)) if a != b),
                             min(len(have[0]), len(seq.blocks)))
                ids, firsts, offs, blocks = extended
                ids.append(seq.seq_id)
                firsts.append(first)
                blocks.extend(seq.blocks[first:])
                offs.append(len(blocks))
        return common_pb2.TableChanges(
            forks=[common_pb2.ForkOp(parent_seq_id=p, child_seq_ids=c) for p, c in self._forks],
            dropped_seq_ids=packed.pack_i64(self._drops),
            started_seq_ids=packed.pack_i64(started[0]), started_context_lens=packed.pack_i32(started[1]),
            started_offsets=packed.pack_i32(started[2]), started_block_ids=packed.pack_i32(started[3]),
            extended_seq_ids=packed.pack_i64(extended[0]), extended_first_index=packed.pack_i32(extended[1]),
            extended_offsets=packed.pack_i32(extended[2]), extended_block_ids=packed.pack_i32(extended[3]))

    def request(self, items, *, cache_ops=None, return_logprobs=False, num_top_logprobs=None,
                num_samples=None, seeds=None, incarnation=0) -> executor_pb2.ExecuteRequest:
        """items: [(seq, num_tokens)] computed now; sequences sample 1 token
        when the chunk reaches the end of their known tokens, else 0."""
        ctx, qlens, toks, samples, temps, top_ps, top_ks, seed_list = [], [], [], [], [], [], [], []
        for i, (seq, q) in enumerate(items):
            start = seq.num_computed
            self.ensure_blocks(seq, start + q)
            ctx.append(start)
            qlens.append(q)
            toks.extend(seq.tokens[start:start + q])
            n = (1 if start + q == len(seq.tokens) else 0) if num_samples is None else num_samples[i]
            samples.append(n)
            temps.append(seq.temperature)
            top_ps.append(seq.top_p)
            top_ks.append(seq.top_k)
            seed_list.extend([seq.seed] * n)
        self.step_id += 1
        sampling = executor_pb2.SamplingBatch(
            num_samples=packed.pack_i32(samples),
            temperature=packed.pack_f32(temps),
            top_p=packed.pack_f32(top_ps),
            top_k=packed.pack_i32(top_ks),
            seeds=packed.pack_i64(seeds if seeds is not None else seed_list),
            return_logprobs=return_logprobs,
        )
        if num_top_logprobs is not None:
            sampling.num_top_logprobs = packed.pack_i32(num_top_logprobs)
        plan = common_pb2.ExecutorPlan(
            executor_id=self.served.info.executor_id, table_epoch=self.epoch,
            seq_ids=packed.pack_i64(seq.seq_id for seq, _ in items), query_lens=packed.pack_i32(qlens),
            tables=self.table_changes(items), cache_ops=cache_ops or common_pb2.CacheOps())
        return executor_pb2.ExecuteRequest(step_id=self.step_id, incarnation=incarnation, plan=plan,
                                           context_lens=packed.pack_i32(ctx), token_ids=packed.pack_i32(toks),
                                           sampling=sampling)

    def sent_tables(self, req: executor_pb2.ExecuteRequest, items) -> None:
        """The executor applied req: remember what it holds now."""
        for parent, children in self._forks:
            for child in children:
                if parent in self.sent:
                    self.sent[child] = self.sent[parent]
        for seq_id in self._drops:
            self.sent.pop(seq_id, None)
        self._forks, self._drops = [], []
        for seq, q in items:
            self.sent[seq.seq_id] = (list(seq.blocks), seq.num_computed + q)

    def step(self, items, **kw) -> executor_pb2.ExecuteResponse:
        """Run one step and apply it: computed counts advance, sampled tokens append."""
        req = self.request(items, **kw)
        resp = self.served.stub.Execute(req, timeout=120)
        self.sent_tables(req, items)
        sampled = list(packed.unpack_i32(resp.sampled_token_ids))
        nums = list(packed.unpack_i32(req.sampling.num_samples))
        pos = 0
        for (seq, q), n in zip(items, nums):
            seq.num_computed += q
            if n == 1:
                seq.tokens.append(sampled[pos])
            pos += n
        return resp

    def decode(self, seqs, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step([(s, 1) for s in seqs])

    def prefill(self, seqs) -> None:
        self.step([(s, len(s.tokens) - s.num_computed) for s in seqs])

    def free(self, seq: Seq) -> None:
        self.alloc.release(seq.blocks)
        seq.blocks = []
        self._drops.append(seq.seq_id)


def prompts(n: int, lengths, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    """Deterministic pseudo-random prompts (token ids 3..vocab-1, no specials)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths[:n]]
