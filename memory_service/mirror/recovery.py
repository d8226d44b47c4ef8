"""Restart recovery: rebuild cached (refcount-0) blocks from the mirror.

A memory service that starts with a Redis URL reads every executor record of
every namespace (discovered through `kvp:namespaces`, never a key scan), asks
each executor over gRPC whether it still holds that pool
(`ConfirmPool(incarnation, pool_generation)`, short deadline), and only for a
confirmed one registers the recorded spec and rebuilds its cached blocks
(evictable, in the free queue, with token ids so every hit is verified) from
its reverse index and block records. Anything unconfirmable (unreachable,
another incarnation or generation, a malformed record) is dropped from the
mirror and never served.

Step fencing: the mirror is write-behind, so a plan may have been executed
(a block overwritten) before its events reached Redis, or published before it
was executed. The record's `last_step_id` P is the step_id of the last Step
that gave this executor rows and whose events are all in Redis; ConfirmPool
answers the step_id A of the last Execute the pool applied.

* A == P: the mirror describes the pool; every recorded block is rebuilt.
* A > P (the usual case after a crash under load: the last few steps' events
  never reached Redis): ConfirmPool is asked for the device blocks steps
  after P wrote (the executor logs recent steps' slot mappings, copy and
  swap-in destinations). Those blocks, and every block whose prefix chain
  runs through one, are left out; the rest is rebuilt, and the record then
  stands for step A. If the executor's log no longer reaches back to P, the
  executor is dropped.
* A < P (a plan published but not executed yet): blocks the mirror calls
  computed may not have been written. With steps planned ahead this is the
  usual case under load: the gateway had already sent Execute P, queued
  behind the step the executor was running. So ConfirmPool is asked again
  until the executor has applied P (`catch_up_s`); if it never does (the
  plan never reached it), the executor is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvpager.packed import unpack_i32
from kvpager.prefix_index.keys import Namespace
from kvpager.prefix_index.reader import executor_blocks, executor_records
from kvpager.telemetry import get_logger
from memory_service.kv_manager import ExecutorSpec
from memory_service.mirror import metrics as m
from memory_service.mirror.records import spec_from_record
from memory_service.mirror.writer import MirrorWriter
from memory_service.service_state import MemoryState

log = get_logger("memory_service.mirror")

@dataclass(frozen=True)
class ConfirmAnswer:
    """A confirmed pool: the step id of the last Execute it applied and, when
    asked and known, the device blocks steps after the asked one wrote."""

    applied: int
    written: frozenset[int] | None = None


# (address, incarnation, pool_generation, timeout_s, written_since_step) -> None / False: not confirmed;
# a ConfirmAnswer; an int: confirmed, the last applied step, writes unknown; True: confirmed, step 0.
ConfirmFn = Callable[[str, int, int, float, int], Awaitable["ConfirmAnswer | bool | int | None"]]


def confirmed_answer(answer) -> ConfirmAnswer | None:
    """A ConfirmFn's answer as a ConfirmAnswer (None: not confirmed)."""
    if answer is None or answer is False:
        return None
    if isinstance(answer, ConfirmAnswer):
        return answer
    return ConfirmAnswer(0 if answer is True else int(answer))


def answer_from_reply(reply, incarnation: int, pool_generation: int) -> ConfirmAnswer | None:
    """A ConfirmPoolResponse (any object with its fields) as a ConfirmAnswer
    (None unless it confirms exactly this pool)."""
    if not (reply.confirmed and reply.incarnation == incarnation and reply.pool_generation == pool_generation):
        return None
    written = frozenset(unpack_i32(reply.written_block_ids)) if reply.writes_known else None
    return ConfirmAnswer(reply.last_step_id, written)


def without_written(entries: list, written: frozenset[int]) -> tuple[list, int]:
    """Mirror entries (depth, hash, block_id, tokens, parent) minus those on a
    written block and every entry whose parent chain runs through one (no
    lookup could reach it). -> (kept, number left out)."""
    gone: set[bytes] = set()
    kept = []
    for e in sorted(entries, key=lambda e: e[0]):  # parents before children
        depth, h, block_id, _tokens, parent = e
        if block_id in written or (parent is not None and parent in gone):
            gone.add(h)
        else:
            kept.append(e)
    return kept, len(entries) - len(kept)



@dataclass
class RecoveryReport:
    restored: dict[str, int] = field(default_factory=dict)   # executor -> blocks rebuilt
    dropped: dict[str, str] = field(default_factory=dict)    # executor -> why
    fenced: dict[str, int] = field(default_factory=dict)     # executor -> mirrored blocks left out (written since)

    @property
    def num_blocks(self) -> int:
        return sum(self.restored.values())


async def recover(state: MemoryState, writer: MirrorWriter, *, confirm: ConfirmFn,
                  confirm_timeout_s: float = 1.0, page: int = 4096, catch_up_s: float = 2.0) -> RecoveryReport:
    """Rebuild confirmed executors' cached blocks into `state`; drop the rest
    from the mirror. Redis errors propagate (the caller starts cold)."""
    client = writer.client
    report = RecoveryReport()
    records = await executor_records(client)

    async def check(ns: Namespace, eid: str,
                    rec: dict[str, str]) -> tuple[ExecutorSpec | None, str, ConfirmAnswer | None]:
        try:
            spec = spec_from_record(eid, rec)
            published = int(rec.get("last_step_id") or 0)
        except (KeyError, ValueError) as exc:
            return None, f"malformed record: {exc}", None
        if not spec.address:
            return None, "no address to confirm with", None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + catch_up_s
        while True:
            answer = confirmed_answer(await confirm(spec.address, spec.incarnation, spec.pool_generation,
                                                    confirm_timeout_s, published))
            if answer is None:
                return None, "not confirmed by the executor", None
            if answer.applied >= published or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)  # Executes already sent to it are still running: let it catch up
        if answer.applied > published and answer.written is None:
            return None, (f"step fence: the executor applied step {answer.applied}, the mirror was flushed "
                          f"only up to step {published}, and the blocks written since are not known"), None
        if answer.applied < published:
            return None, (f"step fence: the mirror holds step {published}, the executor applied only "
                          f"step {answer.applied}"), None
        return spec, "", answer

    checks = await asyncio.gather(*(check(ns, eid, rec) for ns, eid, rec in records))
    for (ns, eid, rec), (spec, why, answer) in zip(records, checks):
        if spec is not None:
            entries = await executor_blocks(client, ns, eid, spec.incarnation, page)
            published = int(rec.get("last_step_id") or 0)
            fenced = 0
            if answer.applied > published:
                entries, fenced = without_written(entries, answer.written)
            # No await from here to the end of this branch: the pool is rebuilt atomically.
            live = state.manager.executors.get(eid)
            if live is not None and (live.spec.incarnation, live.spec.pool_generation) != (
                    spec.incarnation, spec.pool_generation):
                why = "re-registered with another pool during recovery"
            else:
                state.register_executor(spec)
                # What is rebuilt describes the pool as of its last applied step: the rewritten record says so.
                writer.restore_step(eid, answer.applied)
                pool = state.manager.executors[eid].pool
                entries.sort(key=lambda e: -e[0])  # deepest first: evicted before their prefixes
                n = sum(pool.restore_cached(h, block_id, tokens, parent, depth)
                        for depth, h, block_id, tokens, parent in entries)
                report.restored[eid] = n
                if fenced:
                    report.fenced[eid] = fenced
                    m.FENCED_BLOCKS.inc(fenced)
                m.RECOVERED.labels("restored").inc()
                m.RECOVERED_BLOCKS.inc(n)
                log.info("executor recovered from the mirror", executor_id=eid, blocks=n,
                         left_out_written_since_mirror=fenced, mirror_step=published,
                         executor_step=answer.applied, incarnation=spec.incarnation)
                continue
        inc = rec.get("incarnation")
        writer.forget(ns, eid, int(inc) if inc and inc.isdigit() else None)
        report.dropped[eid] = why
        m.RECOVERED.labels("dropped").inc()
        log.info("executor dropped from the mirror", executor_id=eid, reason=why)
    return report
