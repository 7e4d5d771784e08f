"""The gateway's options: one table for the command line and the environment.

Each option has a flag (`--client-timeout`), an environment variable and a default written as
it would be in the environment; its parser turns the text into the setting's value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._middleware import MAX_SECONDS  # 1e9, as the message says

DEFAULT_HEALTH_PATH = "/_idempotency/health"

#: The bounds on a request's head (see `server.py` and `screening.py`).
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_HEADER_BYTES = 32 * 1024


#: uvicorn's log levels (anything else fails inside uvicorn, after the checks, with a traceback).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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


def non_negative_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{text} is negative")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text} is not a port")
    return value


def optional_count(text: str) -> int | None:
    return count(text) if text else None


def words(text: str) -> tuple[str, ...]:
    return tuple(word.strip() for word in text.split(",") if word.strip())


def switch_value(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not one of 1/0, true/false, yes/no, on/off")


def text(value: str) -> str:
    return value


def log_level(text: str) -> str:
    if text not in LOG_LEVELS:
        raise ValueError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text


def optional_text(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class Option:
    field: str
    env: str
    parse: Callable[[str], Any]
    default: str  # as it would be written in the environment ("" means unset)
    help: str
    switch: bool = False  # a boolean: --name / --no-name

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


_P = "IDEMPOTENCY_GATEWAY_"

OPTIONS: tuple[Option, ...] = (
    Option(
        "upstream",
        _P + "UPSTREAM",
        text,
        "",
        "the service to proxy to, e.g. http://127.0.0.1:9000 (required)",
    ),
    Option("database_url", "DATABASE_URL", text, "", "PostgreSQL URL of the key store (required)"),
    Option("host", _P + "HOST", text, "127.0.0.1", "address to listen on"),
    Option("port", _P + "PORT", port, "8080", "port to listen on"),
    Option("workers", _P + "WORKERS", count, "1", "uvicorn worker processes"),
    Option(
        "tenant_header",
        _P + "TENANT_HEADER",
        optional_text,
        "",
        "tenant from this header, set by a trusted layer in front (e.g. X-Consumer-Id)",
    ),
    Option(
        "tenant_from",
        _P + "TENANT_FROM",
        optional_text,
        "",
        "tenant = a digest of this credential header's value (e.g. authorization)",
    ),
    Option(
        "tenant_secret",
        _P + "TENANT_SECRET",
        optional_text,
        "",
        "with --tenant-from: HMAC the credential with this secret (recommended)",
    ),
    Option(
        "lease_seconds",
        "IDEMPOTENCY_LEASE_SECONDS",
        interval,
        "10",
        "in-flight lease, renewed while the upstream works",
    ),
    Option(
        "ttl_seconds",
        "IDEMPOTENCY_TTL_SECONDS",
        interval,
        "86400",
        "how long a finished key is kept",
    ),
    Option(
        "client_timeout",
        _P + "CLIENT_TIMEOUT",
        positive,
        "30",
        "seconds a client waits for its answer before a 504 (keyed requests go on)",
    ),
    Option(
        "upstream_timeout",
        _P + "UPSTREAM_TIMEOUT",
        positive,
        "120",
        "longest silence from the upstream on a keyed request; then its outcome is unknown",
    ),
    Option(
        "exchange_timeout",
        _P + "EXCHANGE_TIMEOUT",
        positive,
        "300",
        "longest a keyed request may take upstream in all; then its outcome is unknown",
    ),
    Option(
        "connect_timeout",
        _P + "CONNECT_TIMEOUT",
        positive,
        "5",
        "seconds to connect to the upstream (or wait for a free connection)",
    ),
    Option(
        "keepalive_expiry",
        _P + "KEEPALIVE_EXPIRY",
        non_negative,
        "4",
        "close idle upstream connections after this; keep it below the upstream's "
        "own keep-alive timeout (Node: 5 s)",
    ),
    Option(
        "max_connections", _P + "MAX_CONNECTIONS", count, "100", "upstream connections per worker"
    ),
    Option(
        "header_timeout",
        _P + "HEADER_TIMEOUT",
        positive,
        f"{DEFAULT_HEADER_TIMEOUT:g}",
        "seconds a client may take to send a request's line and headers (408, closed)",
    ),
    Option(
        "idle_timeout",
        _P + "IDLE_TIMEOUT",
        count,
        "5",
        "close a client's keep-alive connection idle this many whole seconds",
    ),
    Option(
        "body_timeout",
        _P + "BODY_TIMEOUT",
        positive,
        "30",
        "longest pause within a request body (408, closed)",
    ),
    Option(
        "send_timeout",
        _P + "SEND_TIMEOUT",
        positive,
        "30",
        "longest a response waits for a client that does not read it (then closed)",
    ),
    Option(
        "request_buffer_bytes",
        _P + "REQUEST_BUFFER_BYTES",
        non_negative_count,
        "1048576",
        "request bodies are held up to this before an upstream connection is taken",
    ),
    Option(
        "max_header_bytes",
        _P + "MAX_HEADER_BYTES",
        count,
        str(DEFAULT_MAX_HEADER_BYTES),
        "larger request heads get 431",
    ),
    Option(
        "max_header_count",
        _P + "MAX_HEADER_COUNT",
        count,
        "100",
        "requests with more header fields get 431",
    ),
    Option(
        "methods",
        _P + "METHODS",
        words,
        "POST,PATCH",
        "methods covered by idempotency keys (comma-separated)",
    ),
    Option(
        "require_key",
        _P + "REQUIRE_KEY",
        switch_value,
        "0",
        "covered requests without a key get 400 (else keys are optional)",
        switch=True,
    ),
    Option(
        "required_paths",
        _P + "REQUIRED_PATHS",
        words,
        "",
        "only these paths require a key (comma-separated; /prefix/* allowed)",
    ),
    Option(
        "exempt_paths",
        _P + "EXEMPT_PATHS",
        words,
        "",
        "paths never handled by keys (comma-separated; /prefix/* allowed)",
    ),
    Option(
        "max_body_bytes",
        _P + "MAX_BODY_BYTES",
        count,
        "1048576",
        "keyed request bodies larger than this get 413",
    ),
    Option(
        "max_stored_response_bytes",
        _P + "MAX_STORED_RESPONSE_BYTES",
        count,
        "1048576",
        "larger responses are passed on but not replayable",
    ),
    Option(
        "wait_seconds",
        _P + "WAIT_SECONDS",
        non_negative,
        "0",
        "hold a duplicate this long for the first request's answer instead of a 409",
    ),
    Option(
        "max_in_flight_per_tenant",
        _P + "MAX_IN_FLIGHT_PER_TENANT",
        optional_count,
        "",
        "new keys beyond this many in flight per tenant get 429",
    ),
    Option(
        "max_keys_per_tenant",
        _P + "MAX_KEYS_PER_TENANT",
        optional_count,
        "100000",
        "new keys beyond this many stored per tenant get 429 (empty: no bound)",
    ),
    Option(
        "preserve_host",
        _P + "PRESERVE_HOST",
        switch_value,
        "0",
        "send the client's Host upstream instead of the upstream's own",
        switch=True,
    ),
    Option(
        "trust_forwarded",
        _P + "TRUST_FORWARDED",
        switch_value,
        "0",
        "keep X-Forwarded-Proto/-Host, Forwarded, X-Real-IP... set by a proxy in front",
        switch=True,
    ),
    Option(
        "health_path",
        _P + "HEALTH_PATH",
        text,
        DEFAULT_HEALTH_PATH,
        "the gateway's own health check (GET)",
    ),
    Option(
        "apply_schema",
        _P + "APPLY_SCHEMA",
        switch_value,
        "1",
        "apply the key table's schema at startup (safe with many workers)",
        switch=True,
    ),
    Option(
        "maintenance",
        _P + "MAINTENANCE",
        switch_value,
        "1",
        "run the reaper and sweeper in the gateway (one worker does the work)",
        switch=True,
    ),
    Option("access_log", _P + "ACCESS_LOG", switch_value, "1", "uvicorn's access log", switch=True),
    Option(
        "log_level",
        _P + "LOG_LEVEL",
        log_level,
        "info",
        "uvicorn's log level: " + ", ".join(LOG_LEVELS),
    ),
)
