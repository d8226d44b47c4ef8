"""An executor's view of its block tables, rebuilt from plans alone.

Plans carry only what changed in each executor's tables (forks, drops,
starts, extends: ``memory_service.changes``). The tests keep this small,
independent replay of them (plain dicts and lists, nothing shared with the
executor's own implementation) and read every row back whole: its context
length, block table, slots and prefix hit. Works on the memory service's
domain records and, through ``proto_view``, on wire plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpager.packed import unpack_i32, unpack_i64


@dataclass
class Row:
    """One sequence's row of an executor plan, whole."""

    context_len: int
    query_len: int
    block_table: list[int]
    slots: list[int]
    num_cached_tokens: int


@dataclass
class _Tables:
    forks: list
    dropped: list
    started_seq_ids: list
    started_context_lens: list
    started_cached_tokens: list
    started_offsets: list
    started_block_ids: list
    extended_seq_ids: list
    extended_first_index: list
    extended_offsets: list
    extended_block_ids: list


@dataclass
class PlanView:
    executor_id: str
    table_epoch: int
    seq_ids: list
    query_lens: list
    tables: _Tables


def domain_view(plan) -> PlanView:
    """A memory_service.records.ExecutorStepPlan as a PlanView."""
    t = plan.tables
    return PlanView(plan.executor_id, plan.table_epoch, list(plan.seq_ids), list(plan.query_lens), _Tables(
        [(p, list(c)) for p, c in t.forks], list(t.dropped), list(t.started_seq_ids), list(t.started_context_lens),
        list(t.started_cached_tokens), list(t.started_offsets), list(t.started_block_ids),
        list(t.extended_seq_ids), list(t.extended_first_index), list(t.extended_offsets),
        list(t.extended_block_ids)))


def proto_view(plan) -> PlanView:
    """A kvpager.v1.ExecutorPlan as a PlanView."""
    t = plan.tables
    started = list(unpack_i64(t.started_seq_ids))
    return PlanView(plan.executor_id, plan.table_epoch, list(unpack_i64(plan.seq_ids)),
                    list(unpack_i32(plan.query_lens)), _Tables(
                        [(f.parent_seq_id, list(f.child_seq_ids)) for f in t.forks],
                        list(unpack_i64(t.dropped_seq_ids)), started, list(unpack_i32(t.started_context_lens)),
                        list(unpack_i32(plan.started_cached_tokens)) or [0] * len(started),
                        list(unpack_i32(t.started_offsets)) or [0], list(unpack_i32(t.started_block_ids)),
                        list(unpack_i64(t.extended_seq_ids)), list(unpack_i32(t.extended_first_index)),
                        list(unpack_i32(t.extended_offsets)) or [0], list(unpack_i32(t.extended_block_ids))))


@dataclass
class TableMirror:
    """One executor's tables and computed lengths, as its plans say."""

    block_size: int
    epoch: int | None = None
    tables: dict[int, list[int]] = field(default_factory=dict)
    computed: dict[int, int] = field(default_factory=dict)

    def apply(self, plan: PlanView) -> dict[int, Row]:
        """Apply one plan; returns its rows (seq_id -> Row) as they were computed."""
        if plan.table_epoch != self.epoch:  # another registration's tables are void
            self.epoch = plan.table_epoch
            self.tables.clear()
            self.computed.clear()
        t = plan.tables
        for parent, children in t.forks:
            for child in children:
                if parent in self.tables:
                    self.tables[child] = list(self.tables[parent])
                    self.computed[child] = self.computed[parent]
        for seq_id in t.dropped:
            self.tables.pop(seq_id, None)
            self.computed.pop(seq_id, None)
        cached = {}
        for i, seq_id in enumerate(t.started_seq_ids):
            self.tables[seq_id] = t.started_block_ids[t.started_offsets[i]:t.started_offsets[i + 1]]
            self.computed[seq_id] = t.started_context_lens[i]
            cached[seq_id] = t.started_cached_tokens[i]
        for i, seq_id in enumerate(t.extended_seq_ids):
            first = t.extended_first_index[i]
            table = self.tables[seq_id]
            assert first <= len(table), f"seq {seq_id}: extended from {first} but holds {len(table)} blocks"
            self.tables[seq_id] = table[:first] + t.extended_block_ids[t.extended_offsets[i]:t.extended_offsets[i + 1]]
        rows = {}
        bs = self.block_size
        for seq_id, q in zip(plan.seq_ids, plan.query_lens):
            assert seq_id in self.tables, f"row for seq {seq_id}, which has no table at the executor"
            ctx = self.computed[seq_id]
            table = self.tables[seq_id]
            assert ctx + q <= len(table) * bs, f"seq {seq_id}: {ctx + q} tokens in {len(table)} blocks"
            rows[seq_id] = Row(ctx, q, list(table), [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)],
                               cached.get(seq_id, 0))
            self.computed[seq_id] = ctx + q
        return rows


def check_rows(rows_by_executor: dict[str, dict[int, Row]]) -> None:
    """No slot is written twice in a step (a shared block must have been copied first)."""
    for executor_id, rows in rows_by_executor.items():
        seen: set[int] = set()
        for seq_id, row in rows.items():
            assert not seen & set(row.slots), f"{executor_id}: seq {seq_id} writes a slot another row writes"
            seen.update(row.slots)
