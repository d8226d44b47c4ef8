"""The writer's side of the mirror: encoding of the APPLY script's sections
(see scripts.py for the format).

Stored and removed blocks become compact op records; one executor's ops of
one batch travel as ONE script argument, so packing a flush costs a join,
not an argument per field.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from kvpager.prefix_index.keys import Namespace

_LITTLE = sys.byteorder == "little"
TIER_DEVICE = "device"  # where a mirrored block lives
TIER_CPU = "cpu"
TIER_CODES = {TIER_DEVICE: "d", TIER_CPU: "c"}
# Spec fields an executor record carries besides incarnation/lease/batch.
SPEC_FIELDS = ("pool_generation", "address", "num_blocks", "block_size", "num_swap_blocks", "model_id", "dtype",
               "max_model_len", "vocab_size", "adapter", "kv_group_windows")
CLEARED_OP = b"C"


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 (the hash's canonical bytes)."""
    a = array("I", token_ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return tuple(a)


def stored_op(block_hash: bytes, parent_hash: bytes | None, depth: int, block_id: int, token_ids: Iterable[int],
              tier: str = TIER_DEVICE) -> bytes:
    """S<hash><parent><depth><block_id><tier><n><tokens> (F without a parent)."""
    tokens = pack_tokens(token_ids)
    head = f"S{block_hash.hex()}{parent_hash.hex()}" if parent_hash is not None else f"F{block_hash.hex()}"
    return f"{head}{depth:08x}{block_id:08x}{TIER_CODES.get(tier, 'd')}{len(tokens):08x}".encode() + tokens


def removed_op(block_hash: bytes) -> bytes:
    return b"X" + block_hash.hex().encode()


class ScriptCall:
    """The sections of one APPLY call (one namespace)."""

    __slots__ = ("ns", "argv", "sections")

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.argv: list = []
        self.sections: list[tuple[str, str, int, int]] = []  # kind, executor, incarnation, num_ops

    def batch(self, executor_id: str, incarnation: int, batch: int, ops: list[bytes],
              last_step_id: int | None = None) -> None:
        """A batch; `last_step_id` (when given) is written into the record with it."""
        step = "" if last_step_id is None else str(last_step_id)
        self.argv += ("B", executor_id, str(incarnation), batch, len(ops), b"".join(ops), step)
        self.sections.append(("B", executor_id, incarnation, len(ops)))

    def reset(self, executor_id: str, incarnation: int, spec_fields: dict, batch: int,
              last_step_id: int | None = None) -> None:
        """(Re)start a record; spec_fields: every SPEC_FIELDS name -> its value."""
        extra = () if last_step_id is None else (("last_step_id", str(last_step_id)),)
        self.argv += ("R", executor_id, str(incarnation), batch, len(SPEC_FIELDS) + len(extra))
        for name in SPEC_FIELDS:
            self.argv += (name, spec_fields[name])
        for pair in extra:
            self.argv += pair
        self.sections.append(("R", executor_id, incarnation, 0))

    def renew(self, executor_id: str, incarnation: int, address: str) -> None:
        self.argv += ("H", executor_id, str(incarnation), address)
        self.sections.append(("H", executor_id, incarnation, 0))

    def drop(self, executor_id: str, incarnation: int | None) -> None:
        self.argv += ("D", executor_id, "" if incarnation is None else str(incarnation))
        self.sections.append(("D", executor_id, incarnation or 0, 0))
