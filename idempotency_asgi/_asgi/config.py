"""The middleware's options in one place: `IdempotencyConfig`, their defaults and their checks.

Both `IdempotencyMiddleware` and the gateway take one; the gateway's command derives a flag
and an environment variable for each field from the field's own metadata (`help`, `env`,
`parse`), so an option cannot exist in one and not the other.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection
from dataclasses import Field, dataclass, field, fields
from typing import Any

from starlette.types import Scope

DEFAULT_EXCLUDED_HEADERS = frozenset(
    {"date", "server", "set-cookie", "connection", "keep-alive", "transfer-encoding"}
)
"""Response headers never replayed (the default of `excluded_headers`): they describe one
delivery, not the result (Date, Server), must never be handed out twice (Set-Cookie: a session
minted for the first caller), or belong to the connection."""

DEFAULT_REPLAY_HEADERS = ("Idempotent-Replayed",)
"""The header a replay carries, `true` (the default of `replay_headers`): the name Stripe's
API made familiar. Clients written to the IETF draft's examples and to several other
libraries read `Idempotency-Replayed`; name both to serve either."""

#: The isolation levels a request's transaction may be given (`isolation_level`).
ISOLATION_LEVELS = ("read committed", "repeatable read", "serializable")

DEFAULT_RELEASE_STATUSES = frozenset({408, 425, 429})
"""4xx answers that free the key like a 5xx, not stored (the default of `release_statuses`):
they describe the moment, not the request, and storing them would pin a retry to a transient
refusal for ever."""

#: Longest lease or retention accepted: PostgreSQL's intervals and timestamps end not far
#: beyond (a thousand years and more would overflow them).
MAX_SECONDS = 1e9


# -- reading an option from text (the gateway's flags and environment) ----------------------


def number(text: str) -> float:
    """A finite number: "inf" and "nan" parse as floats, and no timeout or lease can be one."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def positive(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise ValueError(f"{text} is not a positive number")
    return value


def non_negative(text: str) -> float:
    value = number(text)
    if not value >= 0:
        raise ValueError(f"{text} is negative")
    return value


def interval(text: str) -> float:
    """Seconds stored as a PostgreSQL interval (a lease, a retention)."""
    value = positive(text)
    if value > MAX_SECONDS:
        raise ValueError(f"{text} is more than 1e9 seconds (PostgreSQL's intervals overflow)")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{text} is not a positive integer")
    return value


def optional_count(text: str) -> int | None:
    return count(text) if text else None


def words(text: str) -> tuple[str, ...]:
    return tuple(word.strip() for word in text.split(",") if word.strip())


def optional_words(text: str) -> tuple[str, ...] | None:
    return words(text) or None


def statuses(text: str) -> frozenset[int]:
    found = frozenset(int(word) for word in words(text))
    if not all(100 <= status <= 599 for status in found):
        raise ValueError(f"{text} holds a number that is not an HTTP status")
    return found


def switch(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not one of 1/0, true/false, yes/no, on/off")


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

#: Names a replay header may not take: they frame the message or belong to one connection
#: (a gateway drops the replay headers from every upstream answer), or already say something
#: else of the answer or of the key.
_NOT_REPLAY_HEADERS = frozenset(
    {
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "host",
        "idempotency-key",
        "idempotency-key-expires",
        "keep-alive",
        "proxy-connection",
        "retry-after",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def header_names(text: str) -> tuple[str, ...]:
    names = words(text)
    for name in names:
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name")
    return names


def optional_text(text: str) -> str | None:
    return text or None


def as_text(value: Any) -> str:
    """An option's value as its environment variable holds it (what the parsers read)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (frozenset, set)):
        value = sorted(value, key=str)
    if isinstance(value, (tuple, list)):
        return ",".join(str(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _option(default: Any, *, env: str, parse: Callable[[str], Any], help: str) -> Any:
    return field(default=default, metadata={"env": env, "parse": parse, "help": help})


_G = "IDEMPOTENCY_GATEWAY_"


@dataclass(frozen=True)
class IdempotencyConfig:
    """What the middleware does with keyed requests. Every field has a default; pass the ones
    to change: `IdempotencyConfig(lease_seconds=5, wait_seconds=2)`. Checked when made: a
    value out of range raises ValueError naming it.

    `IdempotencyMiddleware(config=...)` and `build_gateway(config=...)` take one; the gateway's
    command has a flag and an environment variable for each field. The documentation's
    "Configuration" page lists every field with its type, default and meaning (generated from
    the fields themselves)."""

    methods: Collection[str] = _option(
        ("POST", "PATCH"),
        env=_G + "METHODS",
        parse=words,
        help="methods covered by idempotency keys (others pass through untouched)",
    )
    require_key: bool = _option(
        True,
        env=_G + "REQUIRE_KEY",
        parse=switch,
        help="covered requests without a key get 400 (else a key is honoured but optional)",
    )
    required_paths: Collection[str] | None = _option(
        None,
        env=_G + "REQUIRED_PATHS",
        parse=optional_words,
        help="only these paths require a key (/prefix/* allowed; empty: require_key decides)",
    )
    exempt_paths: Collection[str] = _option(
        (),
        env=_G + "EXEMPT_PATHS",
        parse=words,
        help="paths never touched, even with a key (/prefix/* allowed)",
    )
    lease_seconds: float = _option(
        10.0,
        env="IDEMPOTENCY_LEASE_SECONDS",
        parse=interval,
        help="in-flight lease, renewed while the request runs; a dead owner's key is taken "
        "over after it",
    )
    ttl_seconds: float = _option(
        86400.0,
        env="IDEMPOTENCY_TTL_SECONDS",
        parse=interval,
        help="how long a finished key is replayed",
    )
    max_body_bytes: int = _option(
        1024 * 1024,
        env=_G + "MAX_BODY_BYTES",
        parse=count,
        help="keyed request bodies larger than this get 413 (nothing is reserved)",
    )
    max_stored_response_bytes: int = _option(
        1024 * 1024,
        env=_G + "MAX_STORED_RESPONSE_BYTES",
        parse=count,
        help="larger responses are sent once but not replayable",
    )
    excluded_headers: Collection[str] = _option(
        DEFAULT_EXCLUDED_HEADERS,
        env=_G + "EXCLUDED_HEADERS",
        parse=words,
        help="response headers never replayed",
    )
    fingerprint_headers: Collection[str] = _option(
        (),
        env=_G + "FINGERPRINT_HEADERS",
        parse=words,
        help="request headers that are part of 'the same request'",
    )
    release_statuses: Collection[int] = _option(
        DEFAULT_RELEASE_STATUSES,
        env=_G + "RELEASE_STATUSES",
        parse=statuses,
        help="4xx statuses that free the key like a 5xx (not stored)",
    )
    wait_seconds: float = _option(
        0.0,
        env=_G + "WAIT_SECONDS",
        parse=non_negative,
        help="hold a duplicate this long for the first request's answer instead of a 409",
    )
    max_in_flight_per_tenant: int | None = _option(
        None,
        env=_G + "MAX_IN_FLIGHT_PER_TENANT",
        parse=optional_count,
        help="new keys beyond this many in flight per tenant get 429 (empty: no bound)",
    )
    max_keys_per_tenant: int | None = _option(
        None,
        env=_G + "MAX_KEYS_PER_TENANT",
        parse=optional_count,
        help="new keys beyond this many stored per tenant get 429 (empty: no bound)",
    )
    www_authenticate: str | None = _option(
        None,
        env=_G + "WWW_AUTHENTICATE",
        parse=optional_text,
        help="the challenge a 401 carries, e.g. Bearer",
    )
    replay_headers: Collection[str] = _option(
        DEFAULT_REPLAY_HEADERS,
        env=_G + "REPLAY_HEADERS",
        parse=header_names,
        help="headers a replay carries, each `true` (Idempotent-Replayed, "
        "Idempotency-Replayed, or both)",
    )
    #: Not gateway options: the gateway cannot share its upstream's transaction.
    isolation_level: str | None = field(
        default=None,
        metadata={
            "help": "the request transaction's isolation level: read committed, repeatable "
            "read or serializable (None: the database's default); the atomic mode needs it "
            "here, since its transaction has run the key's statements before the handler"
        },
    )
    atomic: bool | Callable[[Scope], bool] = field(
        default=False,
        metadata={
            "help": "the atomic mode: the key's claim, the handler's writes and its record in "
            "one transaction (True, or a callable choosing requests by their ASGI scope)"
        },
    )

    def __post_init__(self) -> None:
        if not (0 < self.lease_seconds <= MAX_SECONDS and 0 < self.ttl_seconds <= MAX_SECONDS):
            raise ValueError(f"lease_seconds and ttl_seconds must be in (0, {MAX_SECONDS:g}]")
        if not (math.isfinite(self.wait_seconds) and self.wait_seconds >= 0):
            raise ValueError("wait_seconds must be a finite number, 0 or more")
        if self.max_body_bytes < 1 or self.max_stored_response_bytes < 1:
            raise ValueError("max_body_bytes and max_stored_response_bytes must be at least 1")
        for name in ("max_in_flight_per_tenant", "max_keys_per_tenant"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be at least 1, or None for no bound")
        if isinstance(self.methods, str) or not self.methods:
            raise ValueError("methods must name at least one method, as a collection")
        if isinstance(self.replay_headers, str) or not self.replay_headers:
            raise ValueError("replay_headers must name at least one header, as a collection")
        for name in self.replay_headers:
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"replay_headers: {name!r} is not a header name")
            if name.lower() in _NOT_REPLAY_HEADERS:
                raise ValueError(f"replay_headers: {name!r} already means something else")
        if self.isolation_level is not None and self.isolation_level not in ISOLATION_LEVELS:
            raise ValueError(
                f"isolation_level must be one of {', '.join(ISOLATION_LEVELS)}, or None"
            )
        if not (isinstance(self.atomic, bool) or callable(self.atomic)):
            raise ValueError("atomic must be True, False, or a callable taking the ASGI scope")


def options() -> tuple[Field[Any], ...]:
    """The fields the gateway's command takes, each with its `env`, `parse` and `help`
    metadata (every field but those only an application can set, such as `atomic`)."""
    return tuple(option for option in fields(IdempotencyConfig) if "env" in option.metadata)
