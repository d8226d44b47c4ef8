"""The executor's own block tables (executor_service.tables): exact results
of every kind of change, slot mappings, and all-or-nothing on a bad plan."""

from __future__ import annotations

import numpy as np
import pytest

from executor_service.tables import BlockTables, TableChanges
from kvpager.errors import FailedPrecondition, InvalidArgument

BS = 4


def i32(*v):
    return np.array(v, np.int32)


def i64(*v):
    return np.array(v, np.int64)


def starts(*tables: tuple[int, int, list[int]]) -> TableChanges:
    """(seq_id, context_len, blocks) each."""
    offs = np.cumsum([0] + [len(b) for _, _, b in tables]).astype(np.int32)
    return TableChanges(started_seq_ids=i64(*[s for s, _, _ in tables]),
                        started_context_lens=i32(*[c for _, c, _ in tables]), started_offsets=offs,
                        started_block_ids=np.array([x for _, _, b in tables for x in b], np.int32))


def step(t: BlockTables, epoch: int, changes: TableChanges, rows: dict[int, int], context=None):
    seq_ids, q = i64(*rows), i32(*rows.values())
    r = t.resolve(epoch, changes, seq_ids, q, None if context is None else i32(*context))
    t.commit(r, seq_ids, q)
    return r


def snapshot(t: BlockTables):
    return t.epoch, {s: (t.table(s), t.computed(s)) for s in sorted(t._rows)}


def test_start_decode_extend_fork_drop():
    t = BlockTables(num_blocks=32, block_size=BS, max_model_len=64)
    r = step(t, 1, starts((1, 0, [5, 6]), (2, 4, [7, 8])), {1: 6, 2: 1})
    assert r.context_lens.tolist() == [0, 4]
    assert r.slot_mapping.tolist() == [20, 21, 22, 23, 24, 25, 32]
    assert r.tables.tolist() == [[5, 6], [7, 8]]
    assert (t.table(1), t.computed(1), t.table(2), t.computed(2)) == ([5, 6], 6, [7, 8], 5)
    # a decode inside a block: no change at all
    r = step(t, 1, TableChanges(), {1: 1, 2: 1}, context=[6, 5])
    assert r.slot_mapping.tolist() == [26, 33]
    # growth appends; a copy-on-write replaces the tail
    ext = TableChanges(extended_seq_ids=i64(1, 2), extended_first_index=i32(2, 1),
                       extended_offsets=i32(0, 1, 2), extended_block_ids=i32(9, 10))
    r = step(t, 1, ext, {1: 2}, context=[7])
    assert t.table(1) == [5, 6, 9] and t.table(2) == [7, 10]
    assert r.slot_mapping.tolist() == [27, 36]
    # a fork copies table and computed length; a drop forgets; unknown drops are ignored
    fork = TableChanges(forks=[(1, [3, 4])], dropped=i64(2, 99))
    step(t, 1, fork, {})
    assert snapshot(t) == (1, {1: ([5, 6, 9], 9), 3: ([5, 6, 9], 9), 4: ([5, 6, 9], 9)})
    # a fork of a sequence without a table gives a child without one
    step(t, 1, TableChanges(forks=[(42, [5])]), {})
    assert 5 not in t


def test_many_sequences_and_long_tables_in_one_plan():
    """More blocks in one plan than one table may hold; more rows than the initial capacity."""
    t = BlockTables(num_blocks=2000, block_size=BS, max_model_len=32, capacity=4)  # 8 blocks a table
    tables = [(s, 0, list(range(8 * s, 8 * s + 8))) for s in range(100)]
    r = step(t, 1, starts(*tables), {s: 32 for s in range(100)})
    assert len(t) == 100 and t.table(99) == list(range(792, 800))
    assert len(set(r.slot_mapping.tolist())) == 3200


def test_new_epoch_voids_every_table():
    t = BlockTables(num_blocks=16, block_size=BS, max_model_len=64)
    step(t, 1, starts((1, 0, [1])), {1: 2})
    with pytest.raises(FailedPrecondition, match="no table"):
        t.resolve(2, TableChanges(), i64(1), i32(1))
    step(t, 2, starts((1, 0, [3])), {1: 1})
    assert snapshot(t) == (2, {1: ([3], 1)})


@pytest.mark.parametrize("bad, rows, error", [
    (starts((1, 0, [16])), {1: 1}, InvalidArgument),                      # block id past the pool
    (starts((1, 0, [1] * 17)), {}, InvalidArgument),                      # longer than max_model_len allows
    (starts((1, 9, [1, 2])), {}, InvalidArgument),                        # more in cache than the table holds
    (starts((3, 0, [4])), {3: 5}, InvalidArgument),                       # the table is too short for the row
    (TableChanges(), {7: 1}, FailedPrecondition),                         # a row without a table
    (TableChanges(extended_seq_ids=i64(7), extended_first_index=i32(0), extended_offsets=i32(0, 1),
                  extended_block_ids=i32(4)), {}, FailedPrecondition),    # extends what it does not hold
    (TableChanges(extended_seq_ids=i64(1), extended_first_index=i32(5), extended_offsets=i32(0, 1),
                  extended_block_ids=i32(4)), {}, InvalidArgument),       # extends past its end
    (starts((3, 0, [2])), {3: 1, 1: 1}, InvalidArgument),                 # seq 3 and seq 1 both write slot 8
])
def test_a_bad_plan_changes_nothing(bad, rows, error):
    t = BlockTables(num_blocks=16, block_size=BS, max_model_len=64)
    step(t, 1, starts((1, 0, [1, 2])), {1: 4})
    before = snapshot(t)
    with pytest.raises(error):
        t.resolve(1, bad, i64(*rows), i32(*rows.values()))
    assert snapshot(t) == before


def test_the_gateways_count_must_match():
    t = BlockTables(num_blocks=16, block_size=BS, max_model_len=64)
    step(t, 1, starts((1, 0, [1, 2])), {1: 3})
    with pytest.raises(FailedPrecondition, match="out of step"):
        t.resolve(1, TableChanges(), i64(1), i32(1), i32(2))
    step(t, 1, TableChanges(), {1: 1}, context=[3])
    assert t.computed(1) == 4


def test_decode_steps_that_repeat_their_rows_match_fresh_tables():
    """The kept rows of the last step (a decode with no changes reuses them) give
    exactly what tables built from scratch give: same rows, another order, a
    subset, a row given back and taken by a shorter table (padded with 0)."""

    def fresh(state: dict[int, tuple[list[int], int]]) -> BlockTables:
        f = BlockTables(num_blocks=64, block_size=BS, max_model_len=64)
        ids = list(state)
        r = f.resolve(1, starts(*[(s, state[s][1], state[s][0]) for s in ids]), i64(*ids), i32(*[1] * len(ids)))
        f.commit(r, i64(*ids), i32(*[0] * len(ids)))  # tables in, nothing computed yet
        return f

    t = BlockTables(num_blocks=64, block_size=BS, max_model_len=64, capacity=2)
    step(t, 1, starts((1, 1, [5, 6, 7]), (2, 2, [8, 12, 13]), (3, 0, [9, 10])), {1: 1, 2: 1, 3: 1})
    for rows in ({1: 1, 2: 1, 3: 1}, {1: 1, 2: 1, 3: 1}, {3: 1, 1: 1, 2: 1}, {2: 1, 3: 1}, {2: 1, 3: 1}):
        state = {s: (t.table(s), t.computed(s)) for s in rows}
        want = fresh(state).resolve(1, TableChanges(), i64(*rows), i32(*rows.values()))
        got = step(t, 1, TableChanges(), rows)
        assert got.tables.tolist() == want.tables.tolist()
        assert got.slot_mapping.tolist() == want.slot_mapping.tolist()
        assert got.context_lens.tolist() == want.context_lens.tolist()
    # 1 (three blocks) ends; 4 takes its storage row with one block: the padding is 0, not 1's old blocks
    step(t, 1, TableChanges(dropped=i64(1)), {})
    r = step(t, 1, starts((4, 0, [11])), {4: 1, 3: 1})
    assert r.tables.tolist() == [[11, 0], [9, 10]]
    r = step(t, 1, TableChanges(), {4: 1, 3: 1})
    assert r.tables.tolist() == [[11, 0], [9, 10]] and r.slot_mapping.tolist() == [11 * BS + 1, 10 * BS + 3]
    # a row without a table is still refused when the rows repeat but the table is gone
    step(t, 1, TableChanges(dropped=i64(4)), {})
    with pytest.raises(FailedPrecondition):
        t.resolve(1, TableChanges(), i64(4, 3), i32(1, 1))
