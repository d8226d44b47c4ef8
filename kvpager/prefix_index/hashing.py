"""Deterministic prefix hashing of full blocks: the chain every service shares.

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
DIGEST_BYTES = 32  # SHA-256
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


def extend_chain(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int,
                 num_blocks: int) -> list[bytes]:
    """The chain's one implementation: extends ``hashes`` (the first
    len(hashes) block hashes of token_ids) in place to ``num_blocks`` entries
    and returns it. Every user (the memory service's sequences and scoring,
    the router, the mirror's reader) hashes through here."""
    h = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        h = hash_block(h, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(h)
    return hashes


def hash_blocks(root: bytes, token_ids: Sequence[int], block_size: int, start: int = 0,
                parent: bytes | None = None, limit: int | None = None) -> list[bytes]:
    """Hashes of full blocks start, start+1, … of token_ids (chained from parent,
    or from root when start == 0). At most `limit` hashes."""
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, start + limit)
    if start == 0:
        return extend_chain([], root, token_ids, block_size, n_full)
    # Continue a chain whose first `start` hashes are known only through their last one.
    chain = extend_chain([parent], root, token_ids[(start - 1) * block_size:], block_size, n_full - start + 1)
    return chain[1:]


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """A chain as one bytes value (32 bytes a block), as the protos carry it."""
    return b"".join(hashes)


def unpack_hashes(data: bytes) -> list[bytes]:
    """Raises ValueError unless data is whole 32-byte digests."""
    if len(data) % DIGEST_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {DIGEST_BYTES}-byte block hashes")
    return [data[i:i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)]


class PromptChain:
    """One prompt's block-hash chains, computed once per hash namespace and
    shared by everything that needs them for this request: routing, prefix
    scoring (Redis or the memory service) and admission (sent with the new
    sequence, so the memory service does not hash the prompt again)."""

    __slots__ = ("token_ids", "cache_salt", "_chains")

    def __init__(self, token_ids: Sequence[int], cache_salt: str = "") -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._chains: dict[bytes, list[bytes]] = {}  # namespace digest -> the chain

    def hashes(self, namespace: bytes, block_size: int) -> list[bytes]:
        """Hashes of every full block of the prompt in this namespace."""
        chain = self._chains.get(namespace)
        if chain is None:
            chain = extend_chain([], root_hash(namespace, self.cache_salt), self.token_ids, block_size,
                                 len(self.token_ids) // block_size)
            self._chains[namespace] = chain
        return chain
