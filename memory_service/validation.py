"""Step validation: all-or-nothing means everything is checked before anything changes.

A Step is malformed when it names sequences that do not exist (NOT_FOUND),
were freed already (FAILED_PRECONDITION: a double free, told apart by the
ids freed recently), or would exist twice (ALREADY_EXISTS); carries tokens
outside an executor's vocabulary or past a sequence's limit; or asks to
compute what is not there (INVALID_ARGUMENT). The order of checks follows
the order the manager applies a step in: forks, appended tokens, frees,
aborts, new sequences, schedule.

The common step, a decode (one token appended to each of some sequences,
one token scheduled for each of some running ones, nothing else), has a
check of its own (``check_decode``) that costs a few C-level passes over
the ids (dict look-ups by ``map``, sets, ``min``/``max``) and two short
comprehensions, instead of the general walk. It accepts only steps that
``check`` accepts; anything else, or anything wrong, goes to ``check``,
which names the error.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvpager.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvpager.seq_status import SeqStatus
from memory_service.kv_manager import ExecutorKV
from memory_service.records import StepInput
from memory_service.sequence import MAX_LOOKAHEAD, MAX_PENDING, Sequence

# Token ids are hashed as uint32: the bound when an executor registers no vocabulary.
_MAX_TOKEN_ID = 2**32 - 1
# How many freed sequence ids are remembered, to tell a double free
# (FAILED_PRECONDITION) from an id that never existed (NOT_FOUND).
_TOMBSTONES = 65536


def _vocab_bound(kv: ExecutorKV) -> int:
    """Token ids of kv's sequences must be below this."""
    return kv.spec.vocab_size or _MAX_TOKEN_ID + 1


@dataclass(slots=True)
class DecodeStep:
    """A decode step as ``check_decode`` found it: the sequences it names, looked up once."""

    appended: list[Sequence]   # appended_seq_ids' sequences, one token each
    scheduled: list[Sequence]  # schedule_seq_ids' sequences (all RUNNING), one token each


class StepValidator:
    """Checks steps against the manager's live sequences and executors (read only)."""

    def __init__(self, seqs: dict[int, Sequence], executors: dict[str, ExecutorKV], *,
                 max_fork_children: int = 1024) -> None:
        self.seqs = seqs
        self.max_fork_children = max_fork_children  # all forks of one step together (each child copies its parent)
        self.executors = executors
        self._freed: OrderedDict[int, None] = OrderedDict()
        self._unit_offsets = array("i", [0])  # [0, 1, ..., n]: one appended token per sequence
        # Placeholder tokens live sequences hold (kept by the manager): while
        # any exist, appends may replace them, which only the general path does.
        self.pending_total = 0

    def remember_freed(self, seq_id: int) -> None:
        self._freed[seq_id] = None
        if len(self._freed) > _TOMBSTONES:
            self._freed.popitem(last=False)

    def forget_freed(self, seq_id: int) -> None:
        """The id lives again (a new sequence or fork child took it)."""
        self._freed.pop(seq_id, None)

    def missing(self, seq_id: int, what: str) -> Exception:
        if seq_id in self._freed:
            return FailedPrecondition(f"{what}: sequence {seq_id} was already freed")
        return NotFound(f"{what}: unknown sequence {seq_id}")

    def _executor(self, executor_id: str) -> ExecutorKV:
        kv = self.executors.get(executor_id)
        if kv is None:
            raise NotFound(f"unknown executor {executor_id!r}")
        return kv

    def check_decode(self, step: StepInput) -> DecodeStep | None:
        """The step's sequences when it is a valid decode step; None when it is
        anything else or anything in it is wrong (then ``check`` decides).
        Changes nothing."""
        if step.forks or step.free_seq_ids or step.abort_seq_ids or step.new_seqs or step.pending_seq_ids \
                or self.pending_total or step.schedule_lookahead or step.cut_seq_ids or step.carried_seq_ids:
            return None  # placeholders to add or replace: the general path
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        sids, nums = step.schedule_seq_ids, step.schedule_num_tokens
        n, ns = len(ids), len(sids)
        if len(toks) != n or len(nums) != ns:
            return None
        if n:
            unit = self._unit_offsets
            if len(unit) != n + 1:
                unit = self._unit_offsets = array("i", range(n + 1))
            if offs != unit and list(offs) != unit.tolist():
                return None
        elif len(offs) > 1:
            return None
        seqs = self.seqs
        try:
            appended = list(map(seqs.__getitem__, ids))
            # a decode appends to and schedules the same sequences: one look-up
            scheduled = appended if ns == n and sids == ids else list(map(seqs.__getitem__, sids))
        except KeyError:
            return None
        running = SeqStatus.RUNNING
        if n:
            if len(set(ids)) != n or min(toks) < 0 or \
                    max(toks) >= min(map(_vocab_bound, self.executors.values()), default=_MAX_TOKEN_ID + 1):
                return None
            if scheduled is appended:  # room for the token, and running: one pass
                if [s for s in appended if len(s.token_ids) >= s.token_limit or s.status is not running]:
                    return None
            elif [s for s in appended if len(s.token_ids) >= s.token_limit]:
                return None
        if ns:
            if nums.count(1) != ns:
                return None
            if scheduled is not appended:
                if [s for s in scheduled if s.status is not running]:
                    return None
                if len(set(sids)) != ns:
                    return None
                # an appended sequence has a token to compute; any other needs one left
                app = set(ids)
                if [s for s in scheduled if len(s.token_ids) <= s.num_computed and s.seq_id not in app]:
                    return None
        return DecodeStep(appended, scheduled)

    def check(self, step: StepInput) -> None:
        """Raise a domain error for anything malformed; changes nothing."""
        live = self.seqs
        created: dict[int, int] = {}  # children of this step's forks -> parent
        gone: set[int] = set()      # freed/aborted in this step

        def alive(seq_id: int) -> bool:
            return (seq_id in live or seq_id in created) and seq_id not in gone

        num_children = sum(len(children) for _, children in step.forks)
        if num_children > self.max_fork_children:
            raise InvalidArgument(f"fork: {num_children} child sequences; the limit is {self.max_fork_children} "
                                  "per step (max_fork_children)")
        for parent_id, children in step.forks:
            if not alive(parent_id):
                raise self.missing(parent_id, "fork")
            parent = live.get(parent_id)
            if parent is not None and parent.status is SeqStatus.SWAPPED:
                raise FailedPrecondition(f"fork: sequence {parent_id} is swapped out")
            if not children:
                raise InvalidArgument("fork: no child sequence ids")
            if parent is not None and parent.num_pending:
                raise FailedPrecondition(f"fork: sequence {parent_id} has a token still being sampled "
                                         "(fork after its append)")
            for child in children:
                if alive(child) or child in created:
                    raise AlreadyExists(f"fork: sequence {child} already exists")
                created[child] = parent_id
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        if ids or toks or len(offs) > 1:
            if len(offs) != len(ids) + 1 or offs[0] != 0 or offs[-1] != len(toks):
                raise InvalidArgument("appended: offsets must have one more entry than seq_ids and span the tokens")
            if len(set(ids)) != len(ids):
                raise InvalidArgument("appended: a sequence appears twice")
            for i, seq_id in enumerate(ids):
                seq = live.get(seq_id)  # frees come later: nothing is gone yet
                if seq is None:
                    if seq_id not in created:
                        raise self.missing(seq_id, "appended")
                    seq = live[self._origin(seq_id, created)]
                n = offs[i + 1] - offs[i]
                if n < 0:
                    raise InvalidArgument("appended: offsets must not decrease")
                if seq.seq_id == seq_id:
                    n -= min(n, seq.num_pending)  # those replace placeholders
                if len(seq.token_ids) + n > seq.token_limit:
                    raise InvalidArgument(f"appended: sequence {seq_id} would hold {seq.num_tokens + n} tokens, "
                                          f"over its limit of {seq.token_limit}")
            if toks and min(toks) < 0:
                raise InvalidArgument("appended: token ids must be >= 0")
            if toks and max(toks) >= min(map(_vocab_bound, self.executors.values()), default=_MAX_TOKEN_ID + 1):
                for i, seq_id in enumerate(ids):  # rare: find whose vocabulary it leaves
                    chunk = toks[offs[i]:offs[i + 1]]
                    seq = live[self._origin(seq_id, created)]
                    bound = _vocab_bound(self.executors[seq.executor_id])
                    if chunk and max(chunk) >= bound:
                        raise InvalidArgument(f"appended: sequence {seq_id}: token id {max(chunk)} outside the "
                                              f"vocabulary ({bound})")
        for what, seq_ids in (("free", step.free_seq_ids), ("abort", step.abort_seq_ids)):
            for seq_id in seq_ids:
                if seq_id in gone:
                    raise FailedPrecondition(f"{what}: sequence {seq_id} is freed twice in one step")
                if not alive(seq_id):
                    raise self.missing(seq_id, what)
                gone.add(seq_id)
        new_ids = set()
        for new in step.new_seqs:
            if new.seq_id in new_ids or alive(new.seq_id):
                raise AlreadyExists(f"new sequence {new.seq_id} already exists")
            new_ids.add(new.seq_id)
            kv = self._executor(new.executor_id)
            if len(new.prompt_token_ids) == 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: empty prompt")
            if min(new.prompt_token_ids) < 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: token ids must be >= 0")
            vocab = _vocab_bound(kv)
            if max(new.prompt_token_ids) >= vocab:
                raise InvalidArgument(f"new sequence {new.seq_id}: token id {max(new.prompt_token_ids)} "
                                      f"outside the vocabulary ({vocab})")
            if new.max_total_tokens < 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: max_total_tokens must be >= 0")
            if new.prompt_block_hashes is not None and \
                    len(new.prompt_block_hashes) > len(new.prompt_token_ids) // kv.block_size:
                raise InvalidArgument(f"new sequence {new.seq_id}: {len(new.prompt_block_hashes)} prompt block "
                                      f"hashes for {len(new.prompt_token_ids) // kv.block_size} full blocks")
            if new.max_total_tokens and new.max_total_tokens < len(new.prompt_token_ids):
                raise InvalidArgument(f"new sequence {new.seq_id}: max_total_tokens {new.max_total_tokens} is "
                                      f"shorter than its prompt ({len(new.prompt_token_ids)} tokens)")
        sids, nums = step.schedule_seq_ids, step.schedule_num_tokens
        if len(sids) != len(nums):
            raise InvalidArgument("schedule: seq_ids and num_tokens differ in length")
        if len(set(sids)) != len(sids):
            raise InvalidArgument("schedule: a sequence appears twice")
        if nums and min(nums) < 1:
            raise InvalidArgument("schedule: num_tokens must be >= 1")
        appended = {seq_id: offs[i + 1] - offs[i] for i, seq_id in enumerate(ids)} if ids else {}
        pending = set(step.pending_seq_ids)
        if pending:
            if len(pending) != len(step.pending_seq_ids):
                raise InvalidArgument("pending: a sequence appears twice")
            for seq_id in pending:
                seq = live.get(seq_id)
                if seq is None or seq_id in gone:
                    if seq_id in new_ids or seq_id in created:
                        raise FailedPrecondition(f"pending: sequence {seq_id} is new in this step: it has "
                                                 "sampled nothing yet")
                    raise self.missing(seq_id, "pending")
                if seq.status is not SeqStatus.RUNNING:
                    raise FailedPrecondition(f"pending: sequence {seq_id} is {seq.status.name.lower()}, not "
                                             "running: nothing of it is being sampled")
                replaced = min(appended.get(seq_id, 0), seq.num_pending)
                # Behind a burst in flight (its lookahead's placeholders) the next step feeds its last sample.
                if seq.num_pending - replaced + 1 > MAX_PENDING + MAX_LOOKAHEAD:
                    raise FailedPrecondition(f"pending: sequence {seq_id} would hold more than "
                                             f"{MAX_PENDING + MAX_LOOKAHEAD} tokens not yet known")
                if seq.num_tokens + appended.get(seq_id, 0) - replaced + 1 > seq.token_limit:
                    raise InvalidArgument(f"pending: sequence {seq_id} is at its limit of {seq.token_limit} tokens")
        cuts = self._check_cuts(step, live, appended, pending, gone)
        self._check_lookahead(step, live, appended, pending, created, gone, cuts)
        waiting = SeqStatus.WAITING
        for seq_id in sids:
            base = live.get(seq_id)
            if base is None or seq_id in gone or seq_id in created:
                if seq_id in new_ids:
                    continue
                if not alive(seq_id):
                    raise self.missing(seq_id, "schedule")
                base = live[self._origin(seq_id, created)]
            if base.status is not waiting:
                extra = appended.get(seq_id, 0)
                if base.seq_id == seq_id:
                    extra -= min(extra, base.num_pending)
                remaining = base.num_tokens + extra + (seq_id in pending) - base.num_computed
                if seq_id in cuts:  # cut: its last token, computed by no sub-step; carried: its pending one
                    tokens, computed = cuts[seq_id]
                    remaining = tokens + (seq_id in pending) - computed
                if remaining < 1:
                    raise InvalidArgument(f"schedule: sequence {seq_id} has no token left to compute "
                                          "(append the sampled token first)")

    def _check_cuts(self, step: StepInput, live: dict[int, Sequence], appended: dict[int, int], pending: set[int],
                    gone: set[int]) -> dict[int, tuple[int, int]]:
        """Sequences whose burst was cut short -> (their tokens after this
        step's appends and the cut, those computed: all but the last; all of
        them where the burst's next sub-step was carried into the step that
        cut it, ``carried_seq_ids``, whose sample may be pending already). A
        cut gives back at least one computed token (a carried one may give
        back none: the carried sub-step was its burst's last), never one of a
        block the prefix index holds (other sequences may read it), and only
        on an executor with one table for all layers."""
        cuts: dict[int, tuple[int, int]] = {}
        carried = set(step.carried_seq_ids)
        if len(carried) != len(step.carried_seq_ids):
            raise InvalidArgument("carried: a sequence appears twice")
        for seq_id in [*step.cut_seq_ids, *step.carried_seq_ids]:
            seq = live.get(seq_id)
            what = "carried" if seq_id in carried else "cut"
            if seq_id in cuts:
                raise InvalidArgument(f"cut: sequence {seq_id} appears twice (in cut_seq_ids or carried_seq_ids)")
            if seq is None or seq_id in gone:
                raise self.missing(seq_id, what)
            if seq.status is not SeqStatus.RUNNING or (seq_id in pending and seq_id not in carried):
                raise FailedPrecondition(f"{what}: sequence {seq_id} is not a running burst's")
            kv = self._executor(seq.executor_id)
            if kv.grouped:
                raise FailedPrecondition(f"{what}: sequence {seq_id} is on an executor with a table per KV group")
            tokens = seq.num_tokens - seq.num_pending + appended.get(seq_id, 0)
            computed = tokens if seq_id in carried else tokens - 1
            if computed > seq.num_computed or (computed == seq.num_computed and seq_id not in carried):
                raise FailedPrecondition(f"{what}: sequence {seq_id} has {seq.num_computed} tokens computed, "
                                         f"nothing past its {computed} to give back")
            if computed < seq.num_cached_blocks * kv.block_size or tokens <= seq.num_prompt_tokens:
                raise FailedPrecondition(f"{what}: sequence {seq_id} would give back computed tokens of its prompt "
                                         "or of blocks the prefix index holds")
            cuts[seq_id] = (tokens, computed)
        return cuts

    def _check_lookahead(self, step: StepInput, live: dict[int, Sequence], appended: dict[int, int],
                         pending: set[int], created: dict[int, int], gone: set[int],
                         cuts: dict[int, tuple[int, int]]) -> None:
        """A lookahead (decode burst) is for a RUNNING sequence scheduled for
        all its tokens not yet computed, within its token and placeholder limits.
        A child forked in this step is its parent's copy (a fork needs a parent
        with nothing pending): the n completions of a request go on in a burst
        right after their first tokens fan out."""
        ahead = step.schedule_lookahead
        if not ahead:
            return
        sids, nums = step.schedule_seq_ids, step.schedule_num_tokens
        if len(ahead) != len(sids):
            raise InvalidArgument("schedule: lookahead and seq_ids differ in length")
        if min(ahead) < 0 or max(ahead) > MAX_LOOKAHEAD:
            raise InvalidArgument(f"schedule: lookahead must be in [0, {MAX_LOOKAHEAD}]")
        for seq_id, k, m in zip(sids, nums, ahead):
            if not m:
                continue
            seq = live.get(seq_id) if seq_id not in created else live.get(self._origin(seq_id, created))
            if seq is None or seq_id in gone or seq.status is not SeqStatus.RUNNING:
                raise FailedPrecondition(f"schedule: sequence {seq_id} samples ahead (lookahead {m}) but is not "
                                         "running")
            extra = appended.get(seq_id, 0)
            replaced = min(extra, seq.num_pending) if seq.seq_id == seq_id else 0
            tokens = seq.num_tokens + extra - replaced + (seq_id in pending)
            computed = seq.num_computed
            if seq_id in cuts:  # its placeholders go; its last token is not computed (carried: its pending one)
                (tokens, computed), replaced = cuts[seq_id], seq.num_pending
                tokens += seq_id in pending
            if k != tokens - computed:
                raise InvalidArgument(f"schedule: sequence {seq_id} samples ahead, so it computes all its "
                                      f"{tokens - computed} tokens not yet computed, not {k}")
            if tokens + m > seq.token_limit:
                raise InvalidArgument(f"schedule: sequence {seq_id} would pass its limit of {seq.token_limit} "
                                      f"tokens sampling {m} ahead")
            if seq.num_pending - replaced + (seq_id in pending) + m > MAX_PENDING + MAX_LOOKAHEAD:
                raise FailedPrecondition(f"schedule: sequence {seq_id} would hold more than "
                                         f"{MAX_PENDING + MAX_LOOKAHEAD} tokens not yet known")

    def _origin(self, seq_id: int, created: dict[int, int]) -> int:
        """The live sequence whose tokens seq_id holds before this step's appends
        (itself, or the ancestor a fork in this step copied)."""
        while seq_id not in self.seqs:
            seq_id = created[seq_id]
        return seq_id
