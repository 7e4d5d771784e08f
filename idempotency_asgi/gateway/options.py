"""The gateway's options: one table for the command line and the environment.

Each option has a flag (`--client-timeout`), an environment variable and a default written as
it would be in the environment; its parser turns the text into the setting's value.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._asgi.config import (
    DEFAULT_RELEASE_STATUSES,
    IdempotencyConfig,
    as_text,
    count,
    non_negative,
    optional_text,
    options,
    positive,
    statuses,
    switch,
)

DEFAULT_HEALTH_PATH = "/_idempotency/health"
"""The gateway's own health check: GET and HEAD answer 200, anything else 405; never forwarded."""

#: The bounds on a request's head (see `server.py` and `screening.py`).
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_HEADER_BYTES = 32 * 1024

#: The bound on open client connections, per worker (see `server.py`).
DEFAULT_MAX_CLIENT_CONNECTIONS = 1000

#: What frees the key in the gateway besides a 5xx: the middleware's (408, 425, 429), and an
#: upstream's 401 and 403, so that only a credential the upstream accepts can store a key
#: (with `tenant_from_credential`, any string is a tenant).
GATEWAY_RELEASE_STATUSES = DEFAULT_RELEASE_STATUSES | {401, 403}

#: The middleware's options as the gateway has them by default: keys optional in front of an
#: existing API, an upstream's 401 and 403 stored nowhere, and a bound on each tenant's keys
#: (anyone with a credential is a tenant; 100,000 takes a busy client days to reach).
GATEWAY_CONFIG = IdempotencyConfig(
    require_key=False,
    release_statuses=GATEWAY_RELEASE_STATUSES,
    max_keys_per_tenant=100_000,
)

#: uvicorn's log levels (anything else fails inside uvicorn, after the checks, with a traceback).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

#: The HTTP/1.1 parsers the command can serve with (see `server.py`): "auto" is httptools
#: when it is installed, h11 otherwise.
PARSERS = ("auto", "h11", "httptools")


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


def text(value: str) -> str:
    return value


def log_level(text: str) -> str:
    if text not in LOG_LEVELS:
        raise ValueError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text


def parser(text: str) -> str:
    if text not in PARSERS:
        raise ValueError(f"{text!r} is not one of {', '.join(PARSERS)}")
    if text == "httptools" and importlib.util.find_spec("httptools") is None:
        raise ValueError("httptools is not installed (pip install httptools)")
    return text


@dataclass(frozen=True)
class Option:
    field: str
    env: str
    parse: Callable[[str], Any]
    default: str  # as it would be written in the environment ("" means unset)
    help: str
    switch: bool = False  # a boolean: --name / --no-name
    config: bool = False  # one of IdempotencyConfig's: the middleware's own

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


_P = "IDEMPOTENCY_GATEWAY_"

#: The middleware's options, each as IdempotencyConfig declares it, with the gateway's
#: default: the command cannot lack one the middleware has.
CONFIG_OPTIONS: tuple[Option, ...] = tuple(
    Option(
        option.name,
        option.metadata["env"],
        option.metadata["parse"],
        as_text(getattr(GATEWAY_CONFIG, option.name)),
        option.metadata["help"],
        switch=option.metadata["parse"] is switch,
        config=True,
    )
    for option in options()
)

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
        "unverified_statuses",
        _P + "UNVERIFIED_STATUSES",
        statuses,
        "",
        "with --tenant-from: statuses stored for a tenant the upstream has not answered a "
        "2xx yet (its other answers free the key)",
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
        "body_deadline",
        _P + "BODY_DEADLINE",
        positive,
        "60",
        "longest a whole request body may take to arrive (408, closed)",
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
        "65536",
        "request bodies are held in memory up to this, then in a temporary file",
    ),
    Option(
        "request_spool_bytes",
        _P + "REQUEST_SPOOL_BYTES",
        non_negative_count,
        str(64 * 1024 * 1024),
        "request bodies are read whole, up to this, before an upstream connection is taken "
        "(larger get 413; 0: stream them past the memory buffer)",
    ),
    Option(
        "response_buffer_bytes",
        _P + "RESPONSE_BUFFER_BYTES",
        count,
        str(256 * 1024),
        "an answer the client has not taken yet is held in memory up to this, then in a "
        "temporary file",
    ),
    Option(
        "response_spool_bytes",
        _P + "RESPONSE_SPOOL_BYTES",
        non_negative_count,
        str(1024 * 1024 * 1024),
        "an answer's temporary file grows to this; past it the upstream waits for the client",
    ),
    Option(
        "spool_disk_bytes",
        _P + "SPOOL_DISK_BYTES",
        non_negative_count,
        str(2 * 1024 * 1024 * 1024),
        "all of a worker's temporary files together hold at most this; past it request bodies "
        "get 503 and answers wait in memory for their clients",
    ),
    Option(
        "max_client_connections",
        _P + "MAX_CLIENT_CONNECTIONS",
        count,
        str(DEFAULT_MAX_CLIENT_CONNECTIONS),
        "open client connections per worker; past it a new one gets 503 and is closed",
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
        "preserve_host",
        _P + "PRESERVE_HOST",
        switch,
        "0",
        "send the client's Host upstream instead of the upstream's own",
        switch=True,
    ),
    Option(
        "trust_forwarded",
        _P + "TRUST_FORWARDED",
        switch,
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
        switch,
        "1",
        "apply the key table's schema at startup (safe with many workers)",
        switch=True,
    ),
    Option(
        "replay_cache_seconds",
        _P + "REPLAY_CACHE_SECONDS",
        non_negative,
        "2",
        "replays of a record this worker read within this many seconds are answered from "
        "memory, without the database (0: always ask it)",
    ),
    Option(
        "replay_cache_bytes",
        _P + "REPLAY_CACHE_BYTES",
        count,
        str(32 * 1024 * 1024),
        "the most memory those replays take per worker, counted with their objects",
    ),
    Option(
        "maintenance",
        _P + "MAINTENANCE",
        switch,
        "1",
        "run the reaper and sweeper in the gateway (one worker does the work)",
        switch=True,
    ),
    Option("access_log", _P + "ACCESS_LOG", switch, "1", "uvicorn's access log", switch=True),
    Option(
        "log_level",
        _P + "LOG_LEVEL",
        log_level,
        "info",
        "uvicorn's log level: " + ", ".join(LOG_LEVELS),
    ),
    Option(
        "http",
        _P + "HTTP",
        parser,
        "auto",
        "the HTTP/1.1 parser: auto (httptools when installed), h11 or httptools",
    ),
    *CONFIG_OPTIONS,
)
