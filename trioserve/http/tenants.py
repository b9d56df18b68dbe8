"""Tenants: who a request is, by its API key.

Each key is a tenant. Keys come from `--api-key` (repeatable; such a key's
tenant is named ``key-`` and the first 8 hex digits of its SHA-256, so
the name stays the same whatever the order of the flags) and from
`--api-keys-file` (one ``tenant: key`` a line; several lines may give one
tenant several keys, to rotate them; ``#`` starts a comment), which is
read again on SIGHUP. Without any key there is one tenant, ``""``, and no
key is asked for.

What belongs to a tenant (docs/security.md): its sessions and stored
responses (another tenant's id is a 404, as an unknown one is), its share
of the session and response stores (a quota: it makes room from its own
idle state only), its requests in flight (a quota: 429), and its prefix
cache blocks (the cache's hashes are salted with the tenant unless
`--prefix-cache-scope global`). Pure Python: no trio, no quart."""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable
from pathlib import Path

import attrs

from trioserve.errors import TrioserveError

ANONYMOUS = ""  # the one tenant there is without API keys
MISSING_KEY = "missing or wrong API key (send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>')"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class TenantsError(TrioserveError):
    """The API keys file cannot be used: one line naming it, the line and why."""


class TooManyInFlight(TrioserveError):
    """The tenant has as many requests running as it may (HTTP 429)."""

    retry_after = 1.0


def flag_tenant(key: str) -> str:
    """The tenant name of a key given by `--api-key`."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


MAX_KEYS_FILE_BYTES = 1 << 20  # a keys file is a few lines; a bound keeps a wrong path (a device, a log) from being read whole


def _read_small_file(path: str | Path) -> str:
    """The text of a regular file of at most MAX_KEYS_FILE_BYTES; OSError
    or ValueError saying why not (a FIFO, a device or a directory is never
    opened for reading: it could block or never end)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError("not a regular file" if path.exists() else "no such file")
    with path.open("rb") as f:
        data = f.read(MAX_KEYS_FILE_BYTES + 1)
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"larger than {MAX_KEYS_FILE_BYTES} bytes")
    return data.decode("utf-8")


def read_keys_file(path: str | Path) -> list[tuple[str, str]]:
    """(tenant, key) of each line of ``path``; TenantsError naming the line,
    or saying the file has no key at all (an empty or comments-only file
    would otherwise leave the server with no key, that is open to anyone)."""
    try:
        text = _read_small_file(path)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise TenantsError(f"{path}: cannot be read ({exc})") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, colon, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not colon or not key:
            raise TenantsError(f"{path}:{number}: expected 'tenant: key'")
        if not _NAME.fullmatch(tenant):
            raise TenantsError(f"{path}:{number}: a tenant name is 1 to 64 letters, digits and ._- (got {tenant[:70]!r})")
        pairs.append((tenant, key))
    if not pairs:
        raise TenantsError(f"{path}: no 'tenant: key' line (the file is empty or all comments); refusing to run without the keys it should hold")
    return pairs


def _check_unique(pairs: Iterable[tuple[str, str]], where: str) -> dict[str, str]:
    by_key: dict[str, str] = {}
    for tenant, key in pairs:
        if by_key.get(key, tenant) != tenant:
            raise TenantsError(f"{where}: one key is given to two tenants ({by_key[key]!r} and {tenant!r})")
        by_key[key] = tenant
    return by_key


@attrs.define
class Tenants:
    """The keys and their tenants, and each tenant's requests in flight."""

    flag_keys: tuple[str, ...] = ()
    keys_file: str | None = None
    max_in_flight: int | None = None  # per tenant; None: no limit
    _by_key: dict[str, str] = attrs.field(factory=dict)
    in_flight: dict[str, int] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.reload()

    def reload(self) -> None:
        """Read the keys again (the file may have changed): TenantsError,
        and the keys as they were, when it cannot be used."""
        pairs = [(flag_tenant(key), key) for key in self.flag_keys]
        if self.keys_file is not None:
            pairs += read_keys_file(self.keys_file)
        self._by_key = _check_unique(pairs, self.keys_file or "--api-key")

    @property
    def required(self) -> bool:
        """A key is needed (some are configured)."""
        return bool(self._by_key)

    @property
    def names(self) -> list[str]:
        """Every tenant ([""] without keys)."""
        return sorted(set(self._by_key.values())) or [ANONYMOUS]

    def identify(self, authorization: str, api_key: str) -> str | None:
        """The tenant of a request's ``Authorization: Bearer`` or
        ``X-Api-Key`` header value; None when keys are needed and neither
        holds one. Every key is compared, in constant time each, so how
        long it takes says nothing of which key came close."""
        if not self._by_key:
            return ANONYMOUS
        scheme, _, token = authorization.strip().partition(" ")
        offered = [t.strip().encode() for t in (token if scheme.lower() == "bearer" else "", api_key) if t.strip()]
        found = None
        for key, tenant in self._by_key.items():
            for candidate in offered:
                if hmac.compare_digest(candidate, key.encode()) and found is None:
                    found = tenant
        return found

    def share(self, total: int) -> int:
        """One tenant's even share of ``total`` (all of it with one tenant)."""
        return max(1, math.ceil(total / len(self.names)))

    def enter(self, tenant: str) -> None:
        """One more request of ``tenant`` in flight; TooManyInFlight when it has its most."""
        running = self.in_flight.get(tenant, 0)
        if self.max_in_flight is not None and running >= self.max_in_flight:
            raise TooManyInFlight(f"this API key has {running} requests running, the most it may; retry when one ends")
        self.in_flight[tenant] = running + 1

    def leave(self, tenant: str) -> None:
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
