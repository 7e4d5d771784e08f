"""The middleware's options in one place: `IdempotencyConfig`, their defaults and their checks.

Both `IdempotencyMiddleware` and the gateway take one; the gateway's command derives a flag
and an environment variable for each field from the field's own metadata (`help`, `env`,
`parse`), so an option cannot exist in one and not the other.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import Field, dataclass, field, fields
from functools import cached_property
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
refusal for ever. (A 307 or 308 is never stored either, whatever this says: see
_asgi/outcomes.py.)"""

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
    to change: `IdempotencyConfig(lease_seconds=5, wait_seconds=2)`. Checked when made, each
    message naming the option and the value it got: an unknown name or a value of the wrong
    type (a string for a list, `"1d"` for seconds) raises TypeError (a bare string where a
    collection is meant, ValueError), a value out of range ValueError. Make it at import, so
    that a mistake stops the application before it serves anything.

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
        help="headers a replay carries, each set to `replay_value` (Idempotent-Replayed, "
        "Idempotency-Replayed, or both)",
    )
    replay_value: str = _option(
        "true",
        env=_G + "REPLAY_VALUE",
        parse=str.strip,
        help="the value of each replay header (`true`; `?1` for clients that read it as a "
        "structured boolean)",
    )
    omitted_replay_header: str | None = _option(
        None,
        env=_G + "OMITTED_REPLAY_HEADER",
        parse=optional_text,
        help="replay a response too large to store as its status and headers with an empty "
        "body and this header set to `omitted`, e.g. Idempotency-Replay (empty: its retries "
        "get 409 response-not-replayable)",
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
    transaction_idle_seconds: float = field(
        default=20.0,
        metadata={
            "help": "the longest another session may wait on the request's transaction while "
            "it sits idle (a session of the handler's own, blocked on a row the request "
            "wrote): the waiting statement is then cancelled, and a request that fails after "
            "it is answered 500 transaction-idle with its key held (0: never)"
        },
    )
    atomic: bool | Callable[[Scope], bool] = field(
        default=False,
        metadata={
            "help": "the atomic mode: the key's claim, the handler's writes and its record in "
            "one transaction (True, or a callable choosing requests by their ASGI scope)"
        },
    )

    def __new__(cls, *args: Any, **options: Any) -> IdempotencyConfig:
        # Unknown names are refused here, before the generated __init__ says only "unexpected
        # keyword argument": the middleware merges the options it is given by name with
        # `dataclasses.replace`, which passes every name on to the class, so this is where
        # `ttl=3600` is met whichever way it came.
        known = {option.name for option in fields(cls)}
        for name in options:
            if name not in known:
                raise TypeError(_unknown(name, options[name], known))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_collection("methods", self.methods, _token, "method", empty=False)
        _check_bool("require_key", self.require_key)
        if self.required_paths is not None:
            _check_collection("required_paths", self.required_paths, _path, "path")
        _check_collection("exempt_paths", self.exempt_paths, _path, "path")
        for name in ("lease_seconds", "ttl_seconds"):
            value = getattr(self, name)
            if not 0 < _check_number(name, value) <= MAX_SECONDS:
                raise ValueError(
                    f"{name}={value!r}: must be more than 0 and at most 1e9 seconds (past "
                    "that, PostgreSQL's intervals overflow)"
                )
        for name in ("max_body_bytes", "max_stored_response_bytes"):
            _check_count(name, getattr(self, name))
        _check_collection("excluded_headers", self.excluded_headers, _header, "header name")
        _check_collection("fingerprint_headers", self.fingerprint_headers, _header, "header name")
        _check_collection("release_statuses", self.release_statuses, _release_status, "status")
        for name in ("wait_seconds", "transaction_idle_seconds"):
            value = getattr(self, name)
            if not 0 <= _check_number(name, value) <= MAX_SECONDS:
                raise ValueError(f"{name}={value!r}: must be 0 or more (at most 1e9)")
        for name in ("max_in_flight_per_tenant", "max_keys_per_tenant"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), none="or None for no bound")
        if self.www_authenticate is not None:
            _check_text("www_authenticate", self.www_authenticate, _CHALLENGE, "a challenge")
        _check_collection(
            "replay_headers", self.replay_headers, _replay_header, "header name", empty=False
        )
        _check_text("replay_value", self.replay_value, _FIELD_VALUE, "a header value")
        if self.omitted_replay_header is not None:
            _check_one("omitted_replay_header", self.omitted_replay_header, _replay_header)
            if self.omitted_replay_header.lower() in {n.lower() for n in self.replay_headers}:
                raise ValueError(
                    f"omitted_replay_header={self.omitted_replay_header!r}: already one of "
                    "replay_headers; name another header for `omitted`"
                )
        if self.isolation_level is not None and self.isolation_level not in ISOLATION_LEVELS:
            raise ValueError(
                f"isolation_level={self.isolation_level!r}: must be one of "
                f"{', '.join(map(repr, ISOLATION_LEVELS))}, or None (the database's default)"
            )
        _check_atomic(self.atomic)

    @cached_property
    def replay_marks(self) -> tuple[tuple[bytes, bytes], ...]:
        """The headers a replay carries, as they are sent (`replay_headers`, each with
        `replay_value`)."""
        value = self.replay_value.encode("latin-1")
        return tuple((name.lower().encode("latin-1"), value) for name in self.replay_headers)

    @cached_property
    def omitted_mark(self) -> tuple[bytes, bytes] | None:
        """The header an "omitted" replay carries (`omitted_replay_header: omitted`), or None
        when an answer too large to store is not replayed (409 `response-not-replayable`)."""
        if self.omitted_replay_header is None:
            return None
        return self.omitted_replay_header.lower().encode("latin-1"), b"omitted"


# -- the checks: each message names the option and the value it got -------------------------

#: A header's value as the options may set it: visible characters, spaces between them.
_FIELD_VALUE = re.compile(r"[!-~]+(?:[ \t]+[!-~]+)*")
#: What a WWW-Authenticate value may hold: a CR or LF would end the header and start another.
_CHALLENGE = _FIELD_VALUE


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: PostgresStore's options: passed to the middleware by mistake, they are named as the store's.
#: Listed, not read from the store, so that the options never import the database driver; a
#: test keeps the two equal.
STORE_OPTIONS = frozenset(
    {
        "timeout",
        "min_size",
        "max_size",
        "pool_options",
        "statement_connections",
        "batch",
        "replay_cache_seconds",
        "replay_cache_bytes",
    }
)


def _unknown(name: str, value: object, known: Collection[str]) -> str:
    """ "ttl=3600: ... did you mean ttl_seconds?": the options the name starts (ttl, lease,
    exempt), else those it is part of, else the nearest by spelling."""
    if name in STORE_OPTIONS:
        return (
            f"{name}={_shown(value)}: an option of the store, not of the middleware: "
            f"PostgresStore(dsn, {name}={_shown(value)})"
        )
    ordered = sorted(known)
    near = [option for option in ordered if option.startswith(name)]
    near = near or [option for option in ordered if name in option]
    near = near or difflib.get_close_matches(name, ordered, n=2)
    hint = f"; did you mean {' or '.join(near[:2])}?" if near else "."
    return (
        f"{name}={_shown(value)}: not an option of the middleware (an IdempotencyConfig "
        f"field){hint} The options: {', '.join(ordered)}."
    )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={_shown(value)}: must be True or False")


def _check_number(name: str, value: object) -> float:
    """A number of seconds: an int or a float, never a bool (True would be 1 s) nor a str
    ("1d" is not read as a day), and finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={_shown(value)}: must be a number of seconds (an int or a float)")
    if not math.isfinite(value):
        raise ValueError(f"{name}={_shown(value)}: must be a finite number of seconds")
    return float(value)


def _check_count(name: str, value: object, *, none: str = "") -> None:
    or_none = f", {none}" if none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={_shown(value)}: must be an int{or_none}")
    if value < 1:
        raise ValueError(f"{name}={_shown(value)}: must be at least 1{or_none}")


def _check_text(name: str, value: object, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name}={_shown(value)}: must be a str, {what}")
    if not pattern.fullmatch(value):
        raise ValueError(f"{name}={_shown(value)}: not {what}")


def _check_collection(
    name: str, value: object, item: Callable[[Any], None], what: str, *, empty: bool = True
) -> None:
    """A collection of items, each checked by `item` (which raises ValueError naming it).
    A bare str is refused first: it is a collection of its characters, and
    `exempt_paths="/webhooks/*"` would exempt every path through its "*"."""
    if isinstance(value, (str, bytes)):
        raise ValueError(
            f"{name}={_shown(value)}: a string, which would be read as its characters; "
            f"write a list: {name}=[{_shown(value)}]"
        )
    if not isinstance(value, Collection) or isinstance(value, Mapping):
        raise TypeError(f"{name}={_shown(value)}: must be a list, tuple or set of {what}s")
    if not empty and not value:
        raise ValueError(f"{name}={_shown(value)}: must name at least one {what}")
    for entry in value:
        try:
            item(entry)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}={_shown(value)}: {exc}") from None


def _check_one(name: str, value: object, item: Callable[[Any], None]) -> None:
    try:
        item(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}={_shown(value)}: {exc}") from None


def _token(entry: object) -> None:
    if not isinstance(entry, str):
        raise TypeError(f"{_shown(entry)} is not a str")
    if not _TOKEN.fullmatch(entry):
        raise ValueError(f"{entry!r} is not a method name")


def _header(entry: object) -> None:
    if not isinstance(entry, str):
        raise TypeError(f"{_shown(entry)} is not a str")
    if not _TOKEN.fullmatch(entry):
        raise ValueError(f"{entry!r} is not a header name")


def _replay_header(entry: object) -> None:
    _header(entry)
    assert isinstance(entry, str)
    if entry.lower() in _NOT_REPLAY_HEADERS:
        raise ValueError(f"{entry!r} already means something else")


def _path(entry: object) -> None:
    """A route as the application routes it, `/orders`, or a prefix, `/webhooks/*`: one
    without its leading slash would match nothing, and a `*` inside one is taken literally."""
    if not isinstance(entry, str):
        raise TypeError(f"{_shown(entry)} is not a str")
    if not entry.startswith("/"):
        raise ValueError(f"{entry!r} is not a path: paths start with / (e.g. '/{entry}')")
    if "*" in entry[:-1]:
        raise ValueError(f"{entry!r}: * may only end a path, as a prefix (e.g. '/webhooks/*')")


def _release_status(entry: object) -> None:
    """A 4xx (or a 5xx, released anyway): a 2xx in it would free every success's key, and
    each retry would run again."""
    if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
        raise TypeError(f"{_shown(entry)} is not an int status")
    if not 400 <= int(entry) <= 599:
        raise ValueError(f"{entry!r} is not a 4xx or 5xx status")


def _check_atomic(value: object) -> None:
    if isinstance(value, bool):
        return
    if not callable(value):
        raise TypeError(f"atomic={_shown(value)}: must be True, False, or a callable of the scope")
    if inspect.iscoroutinefunction(value):
        # Called without await: its coroutine would count as true for every request.
        raise TypeError(
            f"atomic={_shown(value)}: an async function; it must be a plain one, "
            "returning True or False for the scope"
        )


def options() -> tuple[Field[Any], ...]:
    """The fields the gateway's command takes, each with its `env`, `parse` and `help`
    metadata (every field but those only an application can set, such as `atomic`)."""
    return tuple(option for option in fields(IdempotencyConfig) if "env" in option.metadata)
