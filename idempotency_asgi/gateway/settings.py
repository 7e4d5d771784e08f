"""The gateway's settings, from the command line or the environment.

A flag wins over its environment variable, which wins over the default (see `options.py`).
`idempotency-asgi gateway` parses them, checks them, writes them back into the environment and
starts uvicorn on `create_app`, which reads them again in each worker: with `--workers N`,
uvicorn starts the app from an import string in new processes, and the environment is what
they inherit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .._asgi.config import IdempotencyConfig, as_text
from .._postgres.store import PostgresStore
from ..maintenance import BackgroundMaintenance, Reaper, Sweeper
from .options import CONFIG_OPTIONS, OPTIONS

if TYPE_CHECKING:
    from .app import Gateway

logger = logging.getLogger("idempotency_asgi.gateway")


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
    unverified_statuses: frozenset[int]
    client_timeout: float
    upstream_timeout: float
    exchange_timeout: float
    connect_timeout: float
    keepalive_expiry: float
    max_connections: int
    header_timeout: float
    idle_timeout: int
    body_timeout: float
    body_deadline: float
    send_timeout: float
    request_buffer_bytes: int
    request_spool_bytes: int
    response_buffer_bytes: int
    response_spool_bytes: int
    spool_disk_bytes: int
    max_client_connections: int
    max_header_bytes: int
    max_header_count: int
    preserve_host: bool
    trust_forwarded: bool
    health_path: str
    apply_schema: bool
    replay_cache_seconds: float
    replay_cache_bytes: int
    maintenance: bool
    access_log: bool
    log_level: str
    http: str
    #: the middleware's options (IdempotencyConfig's fields, each a flag of its own)
    config: IdempotencyConfig

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Settings:
        """From every option's value, by field name (see `options.OPTIONS`)."""
        try:
            config = IdempotencyConfig(**{o.field: values[o.field] for o in CONFIG_OPTIONS})
        except ValueError as exc:
            raise ValueError(f"the middleware's options: {exc}") from None
        own = {f.name: values[f.name] for f in fields(cls) if f.name != "config"}
        settings = cls(**own, config=config)
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
        if self.client_timeout > self.exchange_timeout:
            raise ValueError("--client-timeout must not exceed --exchange-timeout")
        if not self.health_path.startswith("/"):
            raise ValueError("--health-path must start with /")

    def environment(self) -> dict[str, str]:
        """These settings as environment variables, for `from_environment` in a worker."""
        return {
            option.env: as_text(getattr(self.config if option.config else self, option.field))
            for option in OPTIONS
        }

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
        store = PostgresStore(
            self.database_url,
            replay_cache_seconds=self.replay_cache_seconds,
            replay_cache_bytes=self.replay_cache_bytes,
        )
        return build_gateway(
            self.upstream,
            store=store,
            tenant=tenant,
            config=self.config,
            maintenance=(
                BackgroundMaintenance(Reaper(store), Sweeper(store)) if self.maintenance else None
            ),
            client_timeout=self.client_timeout,
            upstream_timeout=self.upstream_timeout,
            exchange_timeout=self.exchange_timeout,
            connect_timeout=self.connect_timeout,
            body_timeout=self.body_timeout,
            body_deadline=self.body_deadline,
            send_timeout=self.send_timeout,
            request_buffer_bytes=self.request_buffer_bytes,
            request_spool_bytes=self.request_spool_bytes,
            response_buffer_bytes=self.response_buffer_bytes,
            response_spool_bytes=self.response_spool_bytes,
            spool_disk_bytes=self.spool_disk_bytes,
            unverified_statuses=self.unverified_statuses,
            max_header_bytes=self.max_header_bytes,
            max_header_count=self.max_header_count,
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
    settings = Settings.from_environment()
    open_files(settings)
    return settings.build()


#: Descriptors a worker needs besides its connections: the listening socket, the database
#: pool's connections, logs, the interpreter's own.
_OTHER_FILES = 64


def open_files(settings: Settings) -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit, and log when it is
    still below what the configured connection limits need: each client connection takes a
    socket and may hold two temporary files (its request body, its answer), each upstream
    connection a socket. Past the limit, accept() and the temporary files fail (EMFILE).
    Returns (the limit now, the need)."""
    need = 3 * settings.max_client_connections + settings.max_connections + _OTHER_FILES
    try:
        import resource
    except ImportError:  # pragma: no cover (not on POSIX)
        return 0, need
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        wanted = max(soft, need) if soft != resource.RLIM_INFINITY else soft
    else:
        wanted = hard
    if soft != resource.RLIM_INFINITY and wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the limit on open files from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.warning(
            "open files are limited to %d per worker, and the configured limits may need %d "
            "(%d client connections, each a socket and up to two temporary files, %d upstream "
            "connections, and %d more): past it, new connections and temporary files fail. "
            "Raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower --max-client-connections.",
            soft,
            need,
            settings.max_client_connections,
            settings.max_connections,
            _OTHER_FILES,
        )
    return soft, need
