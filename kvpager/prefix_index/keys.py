"""The mirror's key schema: one namespace per (hash version, model, block size).

Every key of a namespace carries the same Redis Cluster hash tag, so a whole
namespace lives in one slot and one server-side script may touch all of it::

    kvp:namespaces                      set   tags of every namespace (discovery, outside any slot)
    kvp:{<tag>}:meta                    hash  model_id, block_size, hash_version
    kvp:{<tag>}:executors               set   executor ids with a record
    kvp:{<tag>}:ex:<executor_id>        hash  executor record: incarnation, pool_generation,
                                              last_batch, heartbeat_ms, lease_until_ms, status,
                                              address, num_blocks, block_size, ... (the spec)
    kvp:{<tag>}:x:<executor_id>:<inc>   zset  reverse index: hash hex -> depth, per incarnation
    kvp:{<tag>}:b:<hash hex>            hash  block record: p (parent hex, "" at depth 0),
                                              d (depth), t (token ids, packed uint32 LE),
                                              e:<executor_id> -> "<incarnation>:<tier>:<block_id>"
    kvp:{<tag>}:gc, :gco, :gcseq        list/hash/counter  retired reverse indexes awaiting cleanup

`<tag>` is the first 16 hex digits of SHA-256 over (hash version, model id,
block size). Incarnations are 63-bit numbers; they travel and compare as
decimal strings (Lua numbers are doubles).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvpager.prefix_index.hashing import HASH_VERSION

ROOT = "kvp"
NAMESPACES_KEY = f"{ROOT}:namespaces"
OWNER_PREFIX = "e:"  # block-record field of one executor: e:<executor_id>

ENV_URL = "KVPAGER_REDIS_URL"
ENV_USERNAME = "KVPAGER_REDIS_USERNAME"
ENV_PASSWORD = "KVPAGER_REDIS_PASSWORD"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where one (hash version, model, block size) keeps its keys."""

    model_id: str
    block_size: int
    hash_version: int = HASH_VERSION

    @property
    def tag(self) -> str:
        text = f"{self.hash_version}\0{self.model_id}\0{self.block_size}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def prefix(self) -> str:
        return f"{ROOT}:{{{self.tag}}}:"

    @property
    def meta(self) -> str:
        return self.prefix + "meta"

    @property
    def executors(self) -> str:
        return self.prefix + "executors"

    def executor(self, executor_id: str) -> str:
        return f"{self.prefix}ex:{executor_id}"

    def index(self, executor_id: str, incarnation: int | str) -> str:
        return f"{self.prefix}x:{executor_id}:{incarnation}"

    def block(self, hash_hex: str) -> str:
        return f"{self.prefix}b:{hash_hex}"


def prefix_of_tag(tag: str) -> str:
    return f"{ROOT}:{{{tag}}}:"


def redis_kwargs(username: str | None = None, password: str | None = None) -> dict:
    """AUTH credentials for a client: explicit ones, else KVPAGER_REDIS_USERNAME /
    KVPAGER_REDIS_PASSWORD. Credentials inside the URL take precedence over both
    (redis-py applies URL options last)."""
    username = username if username is not None else os.environ.get(ENV_USERNAME)
    password = password if password is not None else os.environ.get(ENV_PASSWORD)
    out = {}
    if username:
        out["username"] = username
    if password:
        out["password"] = password
    return out


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
