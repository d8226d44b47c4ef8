"""Deterministic prefix hashing of full blocks.

h_i = SHA-256(h_{i-1} || tokens_i as little-endian uint32), over full blocks
only. h_{-1} is a namespace digest of (hash version, model id, block size,
dtype, adapter) chained with the request's cache salt, so two tenants or two
models never share a block. Deterministic across processes and machines:
Redis and routers compute the same hashes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HASH_VERSION = 1
_LITTLE = sys.byteorder == "little"


def namespace_digest(model_id: str, block_size: int, dtype: str, adapter: str = "") -> bytes:
    """The per-model root every executor with the same model/layout shares."""
    text = f"kvpager/v{HASH_VERSION}\0{model_id}\0{block_size}\0{dtype}\0{adapter}"
    return hashlib.sha256(text.encode()).digest()


def root_hash(namespace: bytes, cache_salt: str = "") -> bytes:
    """h_{-1} for one request: the namespace chained with its cache salt."""
    if not cache_salt:
        return namespace
    return hashlib.sha256(namespace + b"salt\0" + cache_salt.encode()).digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + _token_bytes(tokens)).digest()


def hash_blocks(root: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
                parent: bytes | None = None, limit: int | None = None) -> list[bytes]:
    """Hashes of full blocks start, start+1, … of token_ids (chained from parent,
    or from root when start == 0). At most `limit` hashes."""
    out = []
    h = root if parent is None else parent
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, start + limit)
    for i in range(start, n_full):
        h = hash_block(h, token_ids[i * block_size:(i + 1) * block_size])
        out.append(h)
    return out


