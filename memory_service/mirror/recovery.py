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
* A < P (a plan published but never executed): blocks the mirror calls
  computed may never have been written; the executor is dropped.
"""

from __future__ import annotations

import asyncio
from binascii import unhexlify
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from redis.exceptions import NoScriptError

from kvpager.channel import make_channel
from kvpager.packed import unpack_i32
from kvpager.telemetry import get_logger
from kvpager.v1 import executor_pb2, executor_pb2_grpc
from memory_service.kv_manager import ExecutorSpec
from memory_service.mirror import metrics as m
from memory_service.mirror.batch import SPEC_FIELDS, unpack_tokens
from memory_service.mirror.keys import NAMESPACES_KEY, Namespace, prefix_of_tag
from memory_service.mirror.scripts import DUMP_SCRIPT
from memory_service.mirror.writer import MirrorWriter
from memory_service.prefix_hash import HASH_VERSION
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
    """A ConfirmPoolResponse as a ConfirmAnswer (None unless it confirms exactly this pool)."""
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

_NO_PARENT = b"-" * 64
_INT_FIELDS = ("num_blocks", "block_size", "num_swap_blocks", "pool_generation", "max_model_len", "vocab_size")


@dataclass
class RecoveryReport:
    restored: dict[str, int] = field(default_factory=dict)   # executor -> blocks rebuilt
    dropped: dict[str, str] = field(default_factory=dict)    # executor -> why
    fenced: dict[str, int] = field(default_factory=dict)     # executor -> mirrored blocks left out (written since)

    @property
    def num_blocks(self) -> int:
        return sum(self.restored.values())


async def confirm_pool_grpc(address: str, incarnation: int, pool_generation: int, timeout_s: float,
                            written_since_step: int = 0) -> ConfirmAnswer | None:
    """ExecutorService.ConfirmPool at `address` (insecure channel; the service passes its own TLS one)."""
    channel = make_channel(address)
    try:
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        reply = await stub.ConfirmPool(
            executor_pb2.ConfirmPoolRequest(incarnation=incarnation, pool_generation=pool_generation,
                                            written_since_step=written_since_step),
            timeout=timeout_s)
        return answer_from_reply(reply, incarnation, pool_generation)
    except grpc.aio.AioRpcError as exc:
        log.info("ConfirmPool failed", address=address, code=exc.code().name)
        return None
    finally:
        await channel.close()


def spec_from_record(executor_id: str, rec: dict[str, str]) -> ExecutorSpec:
    """The ExecutorSpec an executor record holds (ValueError when malformed)."""
    spec = ExecutorSpec(executor_id=executor_id, num_blocks=0, block_size=0, incarnation=int(rec["incarnation"]))
    for name in SPEC_FIELDS:
        if name in rec:
            setattr(spec, name, int(rec[name]) if name in _INT_FIELDS else rec[name])
    if spec.num_blocks <= 0 or spec.block_size <= 0:
        raise ValueError("record without a pool size")
    return spec


async def _records(client) -> list[tuple[Namespace, str, dict[str, str]]]:
    out = []
    for raw_tag in sorted(await client.smembers(NAMESPACES_KEY)):
        tag = raw_tag.decode()
        prefix = prefix_of_tag(tag)
        meta = {k.decode(): v.decode() for k, v in (await client.hgetall(prefix + "meta")).items()}
        if int(meta.get("hash_version", -1)) != HASH_VERSION or "model_id" not in meta:
            continue  # another hash version's namespace: not ours to read or clean
        ns = Namespace(meta["model_id"], int(meta["block_size"]))
        if ns.tag != tag:
            continue
        ids = sorted(e.decode() for e in await client.smembers(ns.executors))
        pipe = client.pipeline(transaction=False)
        for eid in ids:
            pipe.hgetall(ns.executor(eid))
        for eid, rec in zip(ids, await pipe.execute()):
            out.append((ns, eid, {k.decode(): v.decode(errors="replace") for k, v in rec.items()}))
    return out


async def _blocks(client, ns: Namespace, executor_id: str, incarnation: int, page: int) -> list[tuple]:
    """(depth, hash, block_id, token_ids, parent) of every device block the
    executor's reverse index lists with its owner field: one DUMP call per page."""
    out = []
    start = 0
    while True:
        args = (1, ns.executors, ns.prefix, executor_id, str(incarnation), start, start + page - 1)
        try:
            seen, blob = await client.evalsha(DUMP_SCRIPT.sha, *args)
        except NoScriptError:
            await client.script_load(DUMP_SCRIPT.source)
            seen, blob = await client.evalsha(DUMP_SCRIPT.sha, *args)
        pos, n = 0, len(blob)
        while pos < n:  # <hash 64><parent 64><depth 8><block_id 8><n 8><tokens n>
            parent = blob[pos + 64:pos + 128]
            size = int(blob[pos + 144:pos + 152], 16)
            out.append((int(blob[pos + 128:pos + 136], 16), unhexlify(blob[pos:pos + 64]),
                        int(blob[pos + 136:pos + 144], 16), unpack_tokens(blob[pos + 152:pos + 152 + size]),
                        None if parent == _NO_PARENT else unhexlify(parent)))
            pos += 152 + size
        if int(seen) < page:
            return out
        start += page


async def recover(state: MemoryState, writer: MirrorWriter, *, confirm: ConfirmFn = confirm_pool_grpc,
                  confirm_timeout_s: float = 1.0, page: int = 4096) -> RecoveryReport:
    """Rebuild confirmed executors' cached blocks into `state`; drop the rest
    from the mirror. Redis errors propagate (the caller starts cold)."""
    client = writer.client
    report = RecoveryReport()
    records = await _records(client)

    async def check(ns: Namespace, eid: str,
                    rec: dict[str, str]) -> tuple[ExecutorSpec | None, str, ConfirmAnswer | None]:
        try:
            spec = spec_from_record(eid, rec)
            published = int(rec.get("last_step_id") or 0)
        except (KeyError, ValueError) as exc:
            return None, f"malformed record: {exc}", None
        if not spec.address:
            return None, "no address to confirm with", None
        answer = confirmed_answer(await confirm(spec.address, spec.incarnation, spec.pool_generation,
                                                confirm_timeout_s, published))
        if answer is None:
            return None, "not confirmed by the executor", None
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
            entries = await _blocks(client, ns, eid, spec.incarnation, page)
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
