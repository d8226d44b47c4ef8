"""Who a request belongs to, and the prefix-cache namespace that follows.

With a tenant map (``--tenants FILE``: a JSON object ``{"tenant": "token",
...}``) every tenant's token is a bearer credential and the tenant is the
one whose token authenticated the call; the body's ``cache_salt`` may only
narrow that tenant's namespace, never cross into another's. Without one the
tenant is the ``cache_salt`` itself (what it always was).

The effective salt is what the memory service chains into the prefix hash
(``h_{-1}``), so the tenant namespaces every tier at once: the device cache,
the swap pool's sequences, the Redis mirror's keys, KV events and router
scoring. ``--prefix-sharing shared`` lets tenants share prefixes (only the
client's salt narrows then); ``isolated``, the default, keeps each tenant's
blocks its own: the published shared-prefix timing attacks need a hit
across tenants. No grpc here.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path

SHARING = ("isolated", "shared")
MAX_TENANT_CHARS = 256


def load_tenant_tokens(path: str | Path) -> dict[str, str]:
    """``{"tenant": "token"}`` from a JSON file -> {token: tenant}. ValueError on any bad entry."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tenants {path}: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--tenants {path}: expected a non-empty JSON object {{tenant: token}}")
    by_token: dict[str, str] = {}
    for tenant, token in data.items():
        if not tenant or len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
            raise ValueError(f"--tenants {path}: tenant names must be 1-{MAX_TENANT_CHARS} printable characters")
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError(f"--tenants {path}: tenant {tenant!r}: the token must be a string of >= 8 characters")
        if token in by_token:
            raise ValueError(f"--tenants {path}: tenants {by_token[token]!r} and {tenant!r} share a token")
        by_token[token] = tenant
    return by_token


@dataclass(frozen=True)
class Tenants:
    """Identity -> tenant, tenant + client salt -> the effective salt."""

    by_token: dict[str, str] = field(default_factory=dict, repr=False)
    sharing: str = "isolated"

    def __post_init__(self) -> None:
        if self.sharing not in SHARING:
            raise ValueError(f"prefix sharing must be one of {SHARING}, got {self.sharing!r}")

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(self.by_token)

    def of_authorization(self, authorization: str | bytes | None) -> str | None:
        """The tenant whose token is in this ``authorization`` header value
        (``Bearer <token>``), compared in constant time against every token;
        None when it is no tenant's (the deployment's own token, or none)."""
        if not self.by_token or not authorization:
            return None
        given = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        found = None
        for token, tenant in self.by_token.items():
            if hmac.compare_digest(given, f"Bearer {token}".encode()):
                found = tenant
        return found

    def identify(self, authorization: str | bytes | None, cache_salt: str) -> tuple[str, str]:
        """(tenant, effective salt) of one request."""
        if not self.by_token:
            return cache_salt, cache_salt  # no tenant map: the salt is the tenant (as it always was)
        tenant = self.of_authorization(authorization) or ""  # "": a caller holding no tenant's token
        if self.sharing == "shared":
            return tenant, cache_salt
        # Length-prefixed, so no salt a client can send reaches another tenant's namespace.
        return tenant, f"tenant:{len(tenant)}:{tenant}:{cache_salt}"

    def owner(self, authorization: str | bytes | None) -> str | None:
        """A tenant's requests are its own (only it may abort them); None: no tenant."""
        tenant = self.of_authorization(authorization)
        return f"tenant/{tenant}" if tenant is not None else None
