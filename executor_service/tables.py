"""The block tables of the sequences this executor runs (it keeps them; plans
carry only changes, ``memory_service.changes``).

Storage is columnar: one int32 matrix ``[rows, width]`` of block ids (width
= the most blocks a sequence of ``max_model_len`` tokens holds), one row per
live sequence, with its length in blocks and how many of its tokens are
computed. A step is applied in two halves so that a bad plan changes
nothing: ``resolve`` checks the changes and the rows against the tables as
they would be after the changes and computes the step's slot mapping and
padded tables, touching no state; ``commit`` then writes it. Storage past
a table's length holds 0 (the padding a resolved step's tables carry), and
the last committed step's rows are kept so that a decode step repeating them
(no table changes) costs a few gathers over its rows, independent of the
context and without a Python look-up per sequence.

Changes apply in this order: forks (a child's table and computed length
are its parent's; a parent without a table gives a child without one),
drops (unknown ids are ignored: a sequence may end before it ever ran
here), starts (the whole table and the tokens already in cache), extends
(``table[first:]`` replaced). A plan of another ``table_epoch`` (another
registration of this pool, another memory service) voids every table
first.

A sliding-window group's tables (``window`` set; the hybrid KV layout) may
hold holes (-1): blocks its window has passed, given back by the memory
service. A row may then read or write no hole: every block from its first
query's window on must be real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpager.errors import FailedPrecondition, InvalidArgument


def _i32(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def _i64(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass(slots=True)
class TableChanges:
    """A plan's table changes, decoded (rows follow the proto's TableChanges)."""

    forks: list[tuple[int, list[int]]] = field(default_factory=list)
    dropped: np.ndarray = field(default_factory=_i64)
    started_seq_ids: np.ndarray = field(default_factory=_i64)
    started_context_lens: np.ndarray = field(default_factory=_i32)
    started_offsets: np.ndarray = field(default_factory=lambda: _i32([0]))
    started_block_ids: np.ndarray = field(default_factory=_i32)
    extended_seq_ids: np.ndarray = field(default_factory=_i64)
    extended_first_index: np.ndarray = field(default_factory=_i32)
    extended_offsets: np.ndarray = field(default_factory=lambda: _i32([0]))
    extended_block_ids: np.ndarray = field(default_factory=_i32)

    def is_empty(self) -> bool:
        """Nothing changes (a decode step inside its blocks); malformed offsets are not empty."""
        return not (self.forks or len(self.dropped) or len(self.started_seq_ids) or len(self.started_context_lens)
                    or len(self.started_block_ids) or len(self.extended_seq_ids) or len(self.extended_first_index)
                    or len(self.extended_block_ids)) \
            and _unit(self.started_offsets) and _unit(self.extended_offsets)


def _unit(offsets: np.ndarray) -> bool:
    return len(offsets) == 1 and offsets[0] == 0


@dataclass(slots=True)
class Resolved:
    """A checked step's view of the tables, not yet written."""

    reset: bool
    epoch: int
    staged: dict[int, tuple[np.ndarray, int] | None]  # touched sequences -> (table, computed) or None (gone)
    row_ids: np.ndarray          # int64 [n]: each row's storage row, -1 for a staged sequence
    context_lens: np.ndarray     # int64 [n]: tokens in cache before this step
    tables: np.ndarray           # int32 [n, max_blocks]: each row's table, padded with block 0
    slot_mapping: np.ndarray     # int32 [sum(query_lens)]


def _check_ranges(offsets: np.ndarray, num_rows: int, num_values: int, what: str) -> None:
    if len(offsets) != num_rows + 1 or offsets[0] != 0 or offsets[-1] != num_values or np.any(np.diff(offsets) < 0):
        raise InvalidArgument(f"tables.{what}_offsets must rise from 0 to {num_values} over {num_rows} rows")


HOLE = -1  # a sliding-window group's table entry whose block the window passed


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, capacity: int = 64,
                 window: int | None = None) -> None:
        self.window = window  # sliding window of this table group (holes allowed); None = full attention
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)  # the most blocks one sequence holds
        self.epoch = 0
        self._rows: dict[int, int] = {}       # seq_id -> storage row
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._tables = np.zeros((capacity, self.width), np.int32)
        self._lengths = np.zeros(capacity, np.int64)    # blocks
        self._computed = np.zeros(capacity, np.int64)   # tokens
        # The last committed step's rows (seq_ids int64 [n], storage rows int64 [n]): a decode step
        # that repeats them skips the per-sequence look-ups. Void whenever a row is taken or given back.
        self._last_rows: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def table(self, seq_id: int) -> list[int]:
        r = self._rows[seq_id]
        return self._tables[r, : self._lengths[r]].tolist()

    def computed(self, seq_id: int) -> int:
        return int(self._computed[self._rows[seq_id]])

    def clear(self) -> None:
        """Forget every table (the pool's contents were invalidated)."""
        self._free.extend(self._rows.values())
        self._rows.clear()
        self._tables[:] = 0  # past every length: 0 (the padding ``resolve`` reads)
        self._lengths[:] = 0
        self._last_rows = None

    # ---- resolve: check, touch nothing ---------------------------------------------

    def _current(self, seq_id: int, reset: bool) -> tuple[np.ndarray, int] | None:
        if reset:
            return None
        r = self._rows.get(seq_id)
        if r is None:
            return None
        return self._tables[r, : self._lengths[r]], int(self._computed[r])

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        low = HOLE if self.window is not None else 0
        if len(ids) and (int(ids.min()) < low or int(ids.max()) >= self.num_blocks):
            bad = ids[(ids < low) | (ids >= self.num_blocks)][0]
            raise InvalidArgument(f"tables.{what}: block id {int(bad)} outside [0, {self.num_blocks})")

    def _check_width(self, seq_id: int, num_blocks: int) -> None:
        if num_blocks > self.width:
            raise InvalidArgument(f"tables: sequence {seq_id} would hold {num_blocks} blocks; at most {self.width} "
                                  f"fit max_model_len {self.max_model_len}")

    def resolve(self, epoch: int, changes: TableChanges, seq_ids: np.ndarray, query_lens: np.ndarray,
                context_lens: np.ndarray | None = None) -> Resolved:
        """Raises InvalidArgument / FailedPrecondition for a plan that does not
        fit these tables; changes nothing."""
        reset = epoch != self.epoch
        staged: dict[int, tuple[np.ndarray, int] | None] = {}
        if not reset and changes.is_empty():
            return self._resolve_rows(reset, epoch, staged, seq_ids, query_lens, context_lens)

        def state(seq_id: int) -> tuple[np.ndarray, int] | None:
            return staged[seq_id] if seq_id in staged else self._current(seq_id, reset)

        for parent, children in changes.forks:
            p = state(parent)
            for child in children:
                staged[child] = None if p is None else (p[0].copy(), p[1])
        for seq_id in changes.dropped.tolist():
            staged[seq_id] = None
        c = changes
        _check_ranges(c.started_offsets, len(c.started_seq_ids), len(c.started_block_ids), "started")
        if len(c.started_context_lens) != len(c.started_seq_ids):
            raise InvalidArgument("tables.started_context_lens: one per started sequence")
        self._check_ids(c.started_block_ids, "started_block_ids")
        for i, seq_id in enumerate(c.started_seq_ids.tolist()):
            ids = c.started_block_ids[c.started_offsets[i]:c.started_offsets[i + 1]]
            ctx = int(c.started_context_lens[i])
            self._check_width(seq_id, len(ids))
            if not 0 <= ctx <= len(ids) * self.block_size:
                raise InvalidArgument(f"tables: sequence {seq_id} starts with {ctx} tokens in {len(ids)} blocks")
            staged[seq_id] = (ids, ctx)
        _check_ranges(c.extended_offsets, len(c.extended_seq_ids), len(c.extended_block_ids), "extended")
        if len(c.extended_first_index) != len(c.extended_seq_ids):
            raise InvalidArgument("tables.extended_first_index: one per extended sequence")
        self._check_ids(c.extended_block_ids, "extended_block_ids")
        for i, seq_id in enumerate(c.extended_seq_ids.tolist()):
            base = state(seq_id)
            if base is None:
                raise FailedPrecondition(f"tables: extends sequence {seq_id}, which has no table here")
            first = int(c.extended_first_index[i])
            if not 0 <= first <= len(base[0]):
                raise InvalidArgument(f"tables: sequence {seq_id} extended from block {first}, "
                                      f"its table holds {len(base[0])}")
            ids = np.concatenate([base[0][:first], c.extended_block_ids[c.extended_offsets[i]:c.extended_offsets[i + 1]]])
            self._check_width(seq_id, len(ids))
            staged[seq_id] = (ids, base[1])
        return self._resolve_rows(reset, epoch, staged, seq_ids, query_lens, context_lens)

    def _row_ids(self, reset: bool, staged: dict, seq_ids: np.ndarray) -> np.ndarray:
        """Each row's storage row: -1 for a staged sequence, -2 for one without a table."""
        last = self._last_rows
        if not reset and not staged and last is not None and np.array_equal(last[0], seq_ids):
            return last[1]  # the same rows as the last step (read only)
        rows = self._rows
        return np.fromiter((-1 if reset or s in staged else rows.get(s, -2) for s in seq_ids.tolist()),
                           np.int64, len(seq_ids))

    def _resolve_rows(self, reset: bool, epoch: int, staged: dict, seq_ids: np.ndarray, query_lens: np.ndarray,
                      context_lens: np.ndarray | None) -> Resolved:
        def state(seq_id: int) -> tuple[np.ndarray, int] | None:
            return staged[seq_id] if seq_id in staged else self._current(seq_id, reset)

        # The rows: decodes of untouched sequences in one vectorised pass, staged ones one by one.
        n = len(seq_ids)
        row_ids = self._row_ids(reset, staged, seq_ids)
        if np.any(row_ids == -2):
            s = int(seq_ids[np.argmax(row_ids == -2)])
            raise FailedPrecondition(f"row for sequence {s}, which has no table here")
        known = row_ids >= 0
        all_known = bool(known.all())
        if all_known:
            lengths = self._lengths[row_ids]
            ctx = self._computed[row_ids]
        else:
            lengths = np.zeros(n, np.int64)
            ctx = np.zeros(n, np.int64)
            lengths[known] = self._lengths[row_ids[known]]
            ctx[known] = self._computed[row_ids[known]]
        for i in ([] if all_known else np.nonzero(~known)[0].tolist()):
            st = state(int(seq_ids[i]))
            if st is None:
                raise FailedPrecondition(f"row for sequence {int(seq_ids[i])}, which has no table here")
            lengths[i], ctx[i] = len(st[0]), st[1]
        q = query_lens.astype(np.int64)
        total = ctx + q
        short = total > lengths * self.block_size
        if short.any():
            i = int(np.argmax(short))
            raise InvalidArgument(f"sequence {int(seq_ids[i])}: its table holds {int(lengths[i])} blocks, "
                                  f"{-(-int(total[i]) // self.block_size)} needed for {int(total[i])} tokens")
        if n and int(total.max()) > self.max_model_len:
            i = int(np.argmax(total))
            raise InvalidArgument(f"sequence {int(seq_ids[i])}: {int(total[i])} tokens exceed max_model_len "
                                  f"{self.max_model_len}")
        if context_lens is not None and not np.array_equal(context_lens.astype(np.int64), ctx):
            i = int(np.argmax(context_lens.astype(np.int64) != ctx))
            raise FailedPrecondition(f"sequence {int(seq_ids[i])}: the request says {int(context_lens[i])} tokens are "
                                     f"in cache, the executor's tables say {int(ctx[i])} (plans out of step)")

        # Each row's table, padded with block 0 (masked by its length anyway), and the slots written now.
        width = max(1, int(lengths.max())) if n else 1
        if all_known:
            # One gather; storage past a table's length holds 0 (``commit`` keeps it so): the padding.
            tables = self._tables[row_ids, :width]
        else:
            tables = np.zeros((n, width), np.int32)
            if known.any():
                tables[known] = self._tables[row_ids[known], :width]
        for i in ([] if all_known else np.nonzero(~known)[0].tolist()):
            ids = staged[int(seq_ids[i])][0]
            tables[i, : len(ids)] = ids
        num_tokens = int(q.sum())
        bs = self.block_size
        if self.window is not None and n:
            # Every block a row reads (from its first query's window on) or writes must be real.
            first = np.maximum(ctx - self.window + 1, 0) // bs              # [n]
            cols = np.arange(width)[None, :]
            read = (cols >= first[:, None]) & (cols < -(-total // bs)[:, None])
            if np.any(read & (tables < 0)):
                i = int(np.argmax(np.any(read & (tables < 0), axis=1)))
                raise InvalidArgument(f"sequence {int(seq_ids[i])}: a block its window reads is a hole (-1)")
        if num_tokens:
            if num_tokens == n:  # a decode: one token per row, at position ctx
                row_of, pos = np.arange(n), ctx
            else:
                row_of = np.repeat(np.arange(n), q)                               # [T]
                pos = np.arange(num_tokens) - np.repeat(np.cumsum(q) - q, q) + ctx[row_of]  # [T]
            slots = (tables[row_of, pos // bs].astype(np.int64) * bs + pos % bs).astype(np.int32)
            ordered = np.sort(slots)
            if num_tokens > 1 and (ordered[1:] == ordered[:-1]).any():
                raise InvalidArgument("a slot is written twice in one step (two rows share a block without copy-on-write)")
        else:
            slots = np.zeros(0, np.int32)
        return Resolved(reset, epoch, staged, row_ids, ctx, tables, slots)

    # ---- commit ----------------------------------------------------------------------

    def commit(self, resolved: Resolved, seq_ids: np.ndarray, query_lens: np.ndarray) -> None:
        """Write a resolved step: the touched tables, then every row's computed length."""
        if resolved.reset:
            self.clear()
            self.epoch = resolved.epoch
        for seq_id, st in resolved.staged.items():
            r = self._rows.get(seq_id)
            if st is None:
                if r is not None:
                    del self._rows[seq_id]
                    self._tables[r, : self._lengths[r]] = 0
                    self._lengths[r] = 0
                    self._free.append(r)
                    self._last_rows = None
                continue
            if r is None:
                r = self._row()
                self._rows[seq_id] = r
                self._last_rows = None
            ids, computed = st
            old = int(self._lengths[r])
            self._tables[r, : len(ids)] = ids
            if old > len(ids):
                self._tables[r, len(ids):old] = 0  # past the length: 0, the padding ``resolve`` reads
            self._lengths[r] = len(ids)
            self._computed[r] = computed
        rows = self._rows
        row_ids = resolved.row_ids
        staged_rows = row_ids < 0
        if staged_rows.any():
            row_ids = row_ids.copy()
            row_ids[staged_rows] = [rows[int(s)] for s in seq_ids[staged_rows].tolist()]
        self._computed[row_ids] += query_lens.astype(np.int64)
        self._last_rows = (seq_ids.copy(), row_ids)

    def uncompute(self, seq_ids: np.ndarray, counts: np.ndarray) -> None:
        """The last committed step computed ``counts`` fewer tokens of each of
        ``seq_ids`` (live rows) than it said: a decode burst cut short. Each
        table keeps only the blocks its computed tokens fill, as the memory
        service does when it hears of the cut (so no plan has to say so)."""
        rows, bs = self._rows, self.block_size
        for seq_id, n in zip(seq_ids.tolist(), counts.tolist()):
            if n:
                r = rows[seq_id]
                self._computed[r] -= n
                keep, old = -(-int(self._computed[r]) // bs), int(self._lengths[r])
                if keep < old:
                    self._tables[r, keep:old] = 0  # past the length: 0, the padding ``resolve`` reads
                    self._lengths[r] = keep

    def _row(self) -> int:
        if not self._free:
            old = len(self._tables)
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
            self._lengths = np.concatenate([self._lengths, np.zeros_like(self._lengths)])
            self._computed = np.concatenate([self._computed, np.zeros_like(self._computed)])
            self._free.extend(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
