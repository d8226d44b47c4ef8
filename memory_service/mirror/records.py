"""The memory service's records in the mirror's terms: an executor spec as a
namespace and record fields, a KV event as an APPLY op (the encoding itself is
the shared contract in ``kvpager.prefix_index``)."""

from __future__ import annotations

from kvpager.prefix_index.keys import Namespace
from kvpager.prefix_index.ops import SPEC_FIELDS, stored_op
from memory_service.events import BlockStored
from memory_service.kv_manager import ExecutorSpec

_INT_FIELDS = ("num_blocks", "block_size", "num_swap_blocks", "pool_generation", "max_model_len", "vocab_size")


def namespace_of(spec: ExecutorSpec) -> Namespace:
    return Namespace(spec.model_id, spec.block_size)


def spec_fields(spec: ExecutorSpec) -> dict:
    """The record fields (SPEC_FIELDS) of an executor spec."""
    out = {name: getattr(spec, name) for name in SPEC_FIELDS}
    out["kv_group_windows"] = ",".join(map(str, spec.kv_group_windows))  # a table per KV group: their windows
    return out


def spec_from_record(executor_id: str, rec: dict[str, str]) -> ExecutorSpec:
    """The ExecutorSpec an executor record holds (ValueError when malformed)."""
    spec = ExecutorSpec(executor_id=executor_id, num_blocks=0, block_size=0, incarnation=int(rec["incarnation"]))
    for name in SPEC_FIELDS:
        if name in rec:
            if name == "kv_group_windows":
                spec.kv_group_windows = tuple(int(w) for w in rec[name].split(",") if w)
            else:
                setattr(spec, name, int(rec[name]) if name in _INT_FIELDS else rec[name])
    if spec.num_blocks <= 0 or spec.block_size <= 0:
        raise ValueError("record without a pool size")
    return spec


def op_of(ev: BlockStored) -> bytes:
    """The APPLY op of a stored block."""
    return stored_op(ev.block_hash, ev.parent_hash, ev.depth, ev.block_id, ev.token_ids, ev.tier)
