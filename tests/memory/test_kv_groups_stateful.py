"""Property test of the per-group block tables (memory_service.kv_groups):
random admissions (with prefix hits across groups), prefill chunks, decodes,
forks with copy-on-write, swaps out and back and releases on a small pool with a full and two
sliding groups, checked after every rule.

The machine simulates the K/V itself: every slot written holds (group, the
token prefix up to that position), copy-on-write copies move it, and every
slot a sequence's table maps must hold that sequence's own prefix — so a
wrong hit, a block shared wrongly, a stale block or a hole where a window
still reads all fail. Invariants per group: refcounts equal table entries
(plus pinned copy sources), free + used == total, a block in one group at a
time, holes exactly below each sliding window, and at most
⌈W / block_size⌉ + 1 blocks per sequence in a sliding group.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvpager.kv_spec import KvGroupSpec
from memory_service.block_pool import BlockPool
from memory_service.kv_groups import GroupedKV

BS = 4
GROUPS = [KvGroupSpec(None, (0,)), KvGroupSpec(6, (1,)), KvGroupSpec(9, (2,))]
NUM_BLOCKS = 48
PREFIXES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
EXAMPLES = int(os.environ.get("KVPAGER_GROUP_EXAMPLES", "150"))
STEPS = 100
RULES_RUN = [0]


def first_key(group: int, next_pos: int) -> int:
    """The first key the query at next_pos reads (transformers: key > query - W), computed here
    independently of the module under test."""
    window = GROUPS[group].window
    return 0 if window is None else max(0, next_pos - window + 1)


class GroupedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = GroupedKV(BlockPool("e0", NUM_BLOCKS, BS), GROUPS)
        self.seqs: dict[int, object] = {}
        self.next_id = 1
        self.content: dict[int, dict[int, tuple]] = {}  # block id -> offset -> (group, prefix)
        self.swapped: dict[int, object] = {}            # swapped-out sequences
        self.swap_content: dict[int, dict[int, tuple]] = {}  # swap block -> its copy of a block's content
        self.swap_free = list(range(64))

    # ---- the simulated data plane ----------------------------------------------

    def _copies(self) -> None:
        for src, dst in self.kv.take_copies():
            self.content[dst] = dict(self.content.get(src, {}))

    def _write(self, seq, start: int, stop: int) -> None:
        for g, table in enumerate(seq.tables):
            for pos in range(start, stop):
                block = table[pos // BS]
                assert block is not None, "a token is written into a hole"
                self.content.setdefault(block.block_id, {})[pos % BS] = (g, tuple(seq.token_ids[:pos + 1]))

    # ---- rules ----------------------------------------------------------------------

    @rule(prefix=st.sampled_from([0, 1, None]), cut=st.integers(0, 14), tail=st.lists(st.integers(0, 9), max_size=12),
          chunk=st.integers(1, 30))
    def admit(self, prefix, cut, tail, chunk):
        RULES_RUN[0] += 1
        tokens = (PREFIXES[prefix][:cut] if prefix is not None else []) + tail
        if not tokens:
            tokens = [0]
        seq = self.kv.new_seq(self.next_id, tokens, b"root" * 8)
        got = self.kv.admit(seq, chunk)
        if got is None:
            assert all(t == [] for t in seq.tables)
            return
        hit, k = got
        assert hit % BS == 0 and hit < len(tokens) and k == min(chunk, len(tokens) - hit)
        self._check_reads(seq, hit)  # every hit block holds this sequence's own prefix
        self.seqs[self.next_id] = seq
        self.next_id += 1
        self._copies()
        self._write(seq, hit, hit + k)
        self.kv.commit(seq, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 12), token=st.integers(0, 9))
    def step(self, data, k, token):
        RULES_RUN[0] += 1
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        c = seq.num_computed
        if c == len(seq.token_ids):
            seq.token_ids.append(token)  # a decode: the sampled token
            k = 1
        k = min(k, len(seq.token_ids) - c)
        before = [list(t) for t in seq.tables]
        free_before = self.kv.pool.num_free
        need = self.kv.blocks_needed(seq, k)
        if not self.kv.allocate_slots(seq, k):
            assert need > free_before
            assert [list(t) for t in seq.tables] == before and self.kv.pool.num_free == free_before
            return
        assert self.kv.pool.num_free == free_before - need
        self._copies()
        self._write(seq, c, c + k)
        self.kv.commit(seq, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        RULES_RUN[0] += 1
        parent = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        self.seqs[self.next_id] = self.kv.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        RULES_RUN[0] += 1
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        n = sum(self.kv.num_held(seq, g) for g in range(len(GROUPS)))
        if n > len(self.swap_free):
            return
        ids, self.swap_free = self.swap_free[:n], self.swap_free[n:]
        for device, swap in self.kv.swap_out(seq, ids):
            self.swap_content[swap] = dict(self.content.get(device, {}))
        self.swapped[seq_id] = self.seqs.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        RULES_RUN[0] += 1
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        seq = self.swapped[seq_id]
        free = self.kv.pool.num_free
        pairs = self.kv.swap_in(seq)
        if pairs is None:
            assert len(seq.swapped) > free
            return
        for swap, device in pairs:
            self.content[device] = self.swap_content.pop(swap)
            self.swap_free.append(swap)
        self.seqs[seq_id] = self.swapped.pop(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        RULES_RUN[0] += 1
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.kv.release(seq)
        assert all(t == [] for t in seq.tables)

    # ---- invariants -------------------------------------------------------------------

    def _check_reads(self, seq, upto: int) -> None:
        """Every position below ``upto`` a group still reads holds this sequence's K/V."""
        for g, table in enumerate(seq.tables):
            for pos in range(first_key(g, upto), upto):
                block = table[pos // BS]
                assert block is not None, f"group {g}: position {pos} is read but its block is gone"
                got = self.content.get(block.block_id, {}).get(pos % BS)
                assert got == (g, tuple(seq.token_ids[:pos + 1])), f"group {g}, position {pos}: wrong K/V"

    @invariant()
    def tables_and_refcounts(self):
        pool = self.kv.pool
        refs: dict[int, int] = {}
        owner: dict[int, int] = {}
        for seq in self.seqs.values():
            c = seq.num_computed
            for g, table in enumerate(seq.tables):
                assert len(table) == -(-c // BS)
                first = first_key(g, c) // BS  # blocks wholly below the first key are given back
                assert all(b is None for b in table[:first]) and all(b is not None for b in table[first:])
                held = len(table) - first
                if GROUPS[g].window is not None:
                    assert held <= -(-GROUPS[g].window // BS) + 1
                for block in table[first:]:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    assert owner.setdefault(block.block_id, g) == g, "a block in two groups"
            self._check_reads(seq, c)
        pins = {}
        for block in self.kv._pins:
            pins[block.block_id] = pins.get(block.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0) + pins.get(block.block_id, 0)
        assert pool.num_free == sum(1 for b in pool.blocks if b.ref_cnt == 0)
        for h, block in pool.cached.items():
            assert block.block_hash == h
        assert pool.num_cached_free == sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)


def test_grouped_tables_state_machine():
    start = RULES_RUN[0]
    run_state_machine_as_test(GroupedMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    ran = RULES_RUN[0] - start
    print(f"\ngrouped stateful: {ran} rules over {EXAMPLES} examples")
    assert ran >= EXAMPLES * 70, "fewer random operations than promised (70 per example, 10k in CI)"
