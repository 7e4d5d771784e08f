"""The gateway's options, one table for the command line and the environment.

Every option has a flag and an environment variable; a flag wins over the variable, which wins
over the default. `idempotency-asgi gateway` parses them, checks them, writes them back into
the environment and starts uvicorn on `create_app`, which reads them again in each worker:
with `--workers N`, uvicorn starts the app from an import string in new processes, and the
environment is what they inherit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..maintenance import BackgroundMaintenance, Reaper, Sweeper
from ..store import PostgresStore

if TYPE_CHECKING:
    from .app import Gateway

DEFAULT_HEALTH_PATH = "/_idempotency/health"


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text} is not a positive number")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"{text} is negative")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{text} is not a positive integer")
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
        positive,
        "10",
        "in-flight lease, renewed while the upstream works",
    ),
    Option(
        "ttl_seconds",
        "IDEMPOTENCY_TTL_SECONDS",
        positive,
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
        "keep X-Forwarded-Proto/-Host set by a proxy in front, not replace them",
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
        "0",
        "run the reaper and sweeper in the gateway (one worker does the work)",
        switch=True,
    ),
    Option("access_log", _P + "ACCESS_LOG", switch_value, "1", "uvicorn's access log", switch=True),
    Option("log_level", _P + "LOG_LEVEL", text, "info", "uvicorn's log level"),
)


@dataclass(frozen=True)
class Settings:
    upstream: str
    database_url: str
    host: str
    port: int
    workers: int
    tenant_header: str | None
    tenant_from: str | None
    tenant_secret: str | None
    lease_seconds: float
    ttl_seconds: float
    client_timeout: float
    upstream_timeout: float
    connect_timeout: float
    keepalive_expiry: float
    max_connections: int
    methods: tuple[str, ...]
    require_key: bool
    required_paths: tuple[str, ...]
    exempt_paths: tuple[str, ...]
    max_body_bytes: int
    max_stored_response_bytes: int
    wait_seconds: float
    max_in_flight_per_tenant: int | None
    preserve_host: bool
    trust_forwarded: bool
    health_path: str
    apply_schema: bool
    maintenance: bool
    access_log: bool
    log_level: str

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Settings:
        settings = cls(**{f.name: values[f.name] for f in fields(cls)})
        settings.check()
        return settings

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for option in OPTIONS:
            text = env.get(option.env, option.default)
            try:
                values[option.field] = option.parse(text)
            except ValueError as exc:
                raise ValueError(f"{option.env}: {exc}") from None
        return cls.from_values(values)

    def check(self) -> None:
        """Raise ValueError, naming the options, when they cannot work together."""
        if not self.upstream:
            raise ValueError("no upstream: pass --upstream or set IDEMPOTENCY_GATEWAY_UPSTREAM")
        if not self.database_url:
            raise ValueError("no database: pass --database-url or set DATABASE_URL")
        if (self.tenant_header is None) == (self.tenant_from is None):
            raise ValueError("name the tenant with one of --tenant-header or --tenant-from")
        if self.tenant_secret and self.tenant_from is None:
            raise ValueError("--tenant-secret goes with --tenant-from")
        if self.client_timeout > self.upstream_timeout:
            raise ValueError("--client-timeout must not exceed --upstream-timeout")
        if not self.methods:
            raise ValueError("--methods names no method")
        if not self.health_path.startswith("/"):
            raise ValueError("--health-path must start with /")

    def environment(self) -> dict[str, str]:
        """These settings as environment variables, for `from_environment` in a worker."""
        env: dict[str, str] = {}
        for option in OPTIONS:
            value = getattr(self, option.field)
            if value is None:
                text = ""
            elif isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, tuple):
                text = ",".join(value)
            else:
                text = str(value)
            env[option.env] = text
        return env

    def build(self) -> Gateway:
        from .app import build_gateway
        from .tenants import tenant_from_credential, tenant_from_header

        tenant = (
            tenant_from_header(self.tenant_header)
            if self.tenant_header is not None
            else tenant_from_credential(
                self.tenant_from or "authorization", secret=self.tenant_secret
            )
        )
        store = PostgresStore(self.database_url)
        return build_gateway(
            self.upstream,
            store=store,
            tenant=tenant,
            methods=self.methods,
            require_key=self.require_key,
            required_paths=self.required_paths or None,
            exempt_paths=self.exempt_paths,
            lease_seconds=self.lease_seconds,
            ttl_seconds=self.ttl_seconds,
            max_body_bytes=self.max_body_bytes,
            max_stored_response_bytes=self.max_stored_response_bytes,
            wait_seconds=self.wait_seconds,
            max_in_flight_per_tenant=self.max_in_flight_per_tenant,
            maintenance=(
                BackgroundMaintenance(Reaper(store), Sweeper(store)) if self.maintenance else None
            ),
            client_timeout=self.client_timeout,
            upstream_timeout=self.upstream_timeout,
            connect_timeout=self.connect_timeout,
            keepalive_expiry=self.keepalive_expiry,
            max_connections=self.max_connections,
            preserve_host=self.preserve_host,
            trust_forwarded=self.trust_forwarded,
            health_path=self.health_path,
            apply_schema=self.apply_schema,
        )


def create_app() -> Gateway:
    """uvicorn's factory (`--factory idempotency_asgi.gateway.settings:create_app`): the
    gateway configured from the environment."""
    return Settings.from_environment().build()
