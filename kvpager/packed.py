"""Packed little-endian integer arrays for proto ``bytes`` fields.

Block tables, slot mappings and id lists cross every RPC as packed bytes
(~10x cheaper than ``repeated int32`` in Python protobuf). One place decodes
and validates them, so a malformed payload is always INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

from kvpager.errors import InvalidArgument

_LITTLE = sys.byteorder == "little"


def pack_i32(values: Iterable[int]) -> bytes:
    a = array("i", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def pack_i64(values: Iterable[int]) -> bytes:
    a = array("q", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def pack_f32(values: Iterable[float]) -> bytes:
    a = array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack(data: bytes, code: str, size: int, field: str) -> array:
    if len(data) % size:
        raise InvalidArgument(f"{field}: {len(data)} bytes is not a whole number of {size}-byte values")
    a = array(code)
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


def unpack_i32(data: bytes, field: str = "field") -> array:
    return _unpack(data, "i", 4, field)


def unpack_i64(data: bytes, field: str = "field") -> array:
    return _unpack(data, "q", 8, field)


def unpack_f32(data: bytes, field: str = "field") -> array:
    return _unpack(data, "f", 4, field)


def csr_offsets(lengths: Iterable[int]) -> array:
    """[n + 1] int32 offsets for rows of the given lengths."""
    out = array("i", [0])
    total = 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def check_offsets(offsets: Sequence[int], num_rows: int, num_values: int, field: str) -> None:
    """Raise InvalidArgument unless offsets cut num_values values into num_rows rows."""
    if len(offsets) != num_rows + 1:
        raise InvalidArgument(f"{field}: expected {num_rows + 1} offsets, got {len(offsets)}")
    if num_rows and (offsets[0] != 0 or offsets[-1] != num_values):
        raise InvalidArgument(f"{field}: offsets must run from 0 to {num_values}")
    if not num_rows and len(offsets) == 1 and offsets[0] != 0:
        raise InvalidArgument(f"{field}: offsets must start at 0")
    for a, b in zip(offsets, offsets[1:]):
        if b < a:
            raise InvalidArgument(f"{field}: offsets must not decrease")


def array_bytes(a: array) -> bytes:
    """Little-endian bytes of an array (a copy is swapped on big-endian hosts)."""
    if _LITTLE:
        return a.tobytes()
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()
