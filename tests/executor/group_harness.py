"""A stand-in memory service for the hybrid KV layout: the real group
allocator (``memory_service.kv_groups.GroupedKV``) decides every table, with
its window frees, prefix hits, copy-on-write and swaps, and this builds the
ExecuteRequests (a start per row and group each step: whole tables, holes as
-1) and applies the results."""

from __future__ import annotations

from kvpager import packed
from kvpager.kv_spec import KvGroupSpec
from kvpager.v1 import common_pb2, executor_pb2
from memory_service.block_pool import BlockPool
from memory_service.kv_groups import GroupedKV

ROOT = b"\x01" * 32


class GroupPlan:
    def __init__(self, served, num_swap_blocks: int = 0) -> None:
        import random

        info = served.info
        assert info.kv_layout == "hybrid"
        self.served = served
        self.groups = [KvGroupSpec(g.window or None, tuple(g.layers)) for g in info.kv_groups]
        self.kv = GroupedKV(BlockPool("test", info.num_blocks, info.block_size), self.groups)
        self.swap_free = list(range(info.num_swap_blocks))
        self.epoch = random.getrandbits(62) + 1
        self.step_id = 0
        self.next_id = 1
        self.drops: list[int] = []
        self.ops = {"copy": [], "swap_out": [], "swap_in": []}
        self.prompt_lens: dict[int, int] = {}

    def new_seq(self, prompt):
        seq = self.kv.new_seq(self.next_id, list(prompt), ROOT)
        self.prompt_lens[seq.seq_id] = len(prompt)
        self.next_id += 1
        return seq

    def generated(self, seq) -> list[int]:
        return seq.token_ids[self.prompt_lens[seq.seq_id]:]

    def admit(self, seq, chunk: int) -> int:
        """Admit with the prefix hit; returns the tokens to compute in its first step."""
        got = self.kv.admit(seq, chunk)
        assert got is not None, "pool too small for the test"
        return got[1]

    def fork(self, parent):
        child = self.kv.fork(parent, self.next_id)
        self.prompt_lens[child.seq_id] = self.prompt_lens[parent.seq_id]
        self.next_id += 1
        return child

    def free(self, seq) -> None:
        self.kv.release(seq)
        self.drops.append(seq.seq_id)

    def swap_out(self, seq) -> None:
        n = sum(1 for t in seq.tables for b in t if b is not None)
        ids, self.swap_free = self.swap_free[:n], self.swap_free[n:]
        self.ops["swap_out"] += self.kv.swap_out(seq, ids)
        self.drops.append(seq.seq_id)

    def swap_in(self, seq) -> None:
        pairs = self.kv.swap_in(seq)
        assert pairs is not None
        self.ops["swap_in"] += pairs
        self.swap_free += [s for s, _ in pairs]  # reusable after this step (tests take none meanwhile)

    def recompute(self, seq, chunk: int) -> int:
        """Preempt by recompute and re-admit: its own cached blocks are a prefix hit."""
        self.free(seq)
        return self.admit(seq, chunk)

    def _tables(self, items, group: int) -> common_pb2.TableChanges:
        ids, ctx, offs, blocks = [], [], [0], []
        for seq, _ in items:
            ids.append(seq.seq_id)
            ctx.append(seq.num_computed)
            blocks += [-1 if b is None else b.block_id for b in seq.tables[group]]
            offs.append(len(blocks))
        t = common_pb2.TableChanges(started_seq_ids=packed.pack_i64(ids), started_context_lens=packed.pack_i32(ctx),
                                    started_offsets=packed.pack_i32(offs), started_block_ids=packed.pack_i32(blocks))
        if group == 0:
            t.dropped_seq_ids = packed.pack_i64(self.drops)
        return t

    def step(self, items, grow: bool = True) -> None:
        """items: [(seq, k)]: k tokens of each computed now (allocated here
        unless the sequence was just admitted: grow=False for those)."""
        for seq, k in items:
            if grow:
                assert self.kv.allocate_slots(seq, k), "pool too small for the test"
        self.ops["copy"] += self.kv.take_copies()
        toks, qlens, samples = [], [], []
        for seq, k in items:
            toks += seq.token_ids[seq.num_computed:seq.num_computed + k]
            qlens.append(k)
            samples.append(1 if seq.num_computed + k == len(seq.token_ids) else 0)
        self.step_id += 1

        def pairs(name):
            return [p[0] for p in self.ops[name]], [p[1] for p in self.ops[name]]

        (cs, cd), (os_, od), (is_, id_) = pairs("copy"), pairs("swap_out"), pairs("swap_in")
        ops = common_pb2.CacheOps(copy_src=packed.pack_i32(cs), copy_dst=packed.pack_i32(cd),
                                  swap_out_src=packed.pack_i32(os_), swap_out_dst=packed.pack_i32(od),
                                  swap_in_src=packed.pack_i32(is_), swap_in_dst=packed.pack_i32(id_))
        plan = common_pb2.ExecutorPlan(
            executor_id=self.served.info.executor_id, table_epoch=self.epoch,
            seq_ids=packed.pack_i64(seq.seq_id for seq, _ in items), query_lens=packed.pack_i32(qlens),
            tables=self._tables(items, 0), group_tables=[self._tables(items, g) for g in range(1, len(self.groups))],
            cache_ops=ops)
        sampling = executor_pb2.SamplingBatch(
            num_samples=packed.pack_i32(samples), temperature=packed.pack_f32([0.0] * len(items)),
            top_p=packed.pack_f32([1.0] * len(items)), top_k=packed.pack_i32([0] * len(items)),
            seeds=packed.pack_i64([0] * sum(samples)))
        req = executor_pb2.ExecuteRequest(step_id=self.step_id, plan=plan, token_ids=packed.pack_i32(toks),
                                          context_lens=packed.pack_i32([s.num_computed for s, _ in items]),
                                          sampling=sampling)
        resp = self.served.stub.Execute(req, timeout=120)
        self.drops = []
        self.ops = {"copy": [], "swap_out": [], "swap_in": []}
        sampled = list(packed.unpack_i32(resp.sampled_token_ids))
        pos = 0
        for (seq, k), n in zip(items, samples):
            self.kv.commit(seq, k)
            if n:
                seq.token_ids.append(sampled[pos])
                pos += 1

    def decode(self, seqs, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step([(s, 1) for s in seqs])
