"""Every option is checked when the configuration is made, and a mistake names the option and
the value it got: a misconfiguration never switches protection off quietly, nor waits for the
first request to fail.

Each case below was accepted before (or failed later with a message that named nothing):
`exempt_paths="/webhooks/*"` exempted every path through its "*", `required_paths="/orders"`
left POST /orders unprotected, `ttl=3600` made every request a 500, `ttl_seconds="1d"` failed
inside a comparison."""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette

from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore
from idempotency_asgi._asgi.config import STORE_OPTIONS

ROOT = Path(__file__).resolve().parent.parent


async def _async_choice(scope: Any) -> bool:
    return True


MISTAKES = [
    # A bare string where a collection is meant: read as its characters.
    ({"exempt_paths": "/webhooks/*"}, ValueError, "exempt_paths='/webhooks/*': a string"),
    ({"required_paths": "/orders"}, ValueError, "required_paths='/orders': a string"),
    ({"excluded_headers": "set-cookie"}, ValueError, "excluded_headers='set-cookie': a string"),
    ({"fingerprint_headers": "x-version"}, ValueError, "fingerprint_headers='x-version': a str"),
    ({"methods": "POST"}, ValueError, "methods='POST': a string"),
    ({"replay_headers": "Idempotent-Replayed"}, ValueError, "replay_headers='Idempotent-Re"),
    ({"exempt_paths": b"/webhooks/*"}, ValueError, "exempt_paths=b'/webhooks/*': a string"),
    ({"exempt_paths": None}, TypeError, "exempt_paths=None: must be a list"),
    ({"release_statuses": 409}, TypeError, "release_statuses=409: must be a list"),
    # What a collection holds.
    ({"required_paths": ["orders"]}, ValueError, "'orders' is not a path"),
    ({"exempt_paths": ["/a/*/b"]}, ValueError, "* may only end a path"),
    ({"fingerprint_headers": ["x version"]}, ValueError, "'x version' is not a header name"),
    ({"excluded_headers": [b"date"]}, TypeError, "b'date' is not a str"),
    ({"release_statuses": {200}}, ValueError, "200 is not a 4xx or 5xx status"),
    ({"release_statuses": {"429"}}, TypeError, "'429' is not an int status"),
    ({"release_statuses": {True}}, TypeError, "True is not an int status"),
    ({"methods": ()}, ValueError, "methods=(): must name at least one"),
    # Numbers: their type, then their range.
    ({"ttl_seconds": "1d"}, TypeError, "ttl_seconds='1d': must be a number of seconds"),
    ({"lease_seconds": None}, TypeError, "lease_seconds=None: must be a number"),
    ({"wait_seconds": True}, TypeError, "wait_seconds=True: must be a number"),
    ({"wait_seconds": -1}, ValueError, "wait_seconds=-1: must be 0 or more"),
    ({"wait_seconds": math.inf}, ValueError, "wait_seconds=inf: must be a finite number"),
    ({"lease_seconds": 0}, ValueError, "lease_seconds=0: must be more than 0"),
    ({"ttl_seconds": 1e12}, ValueError, "ttl_seconds=1000000000000.0: must be more than 0"),
    ({"max_body_bytes": 1e6}, TypeError, "max_body_bytes=1000000.0: must be an int"),
    ({"max_body_bytes": "1MB"}, TypeError, "max_body_bytes='1MB': must be an int"),
    ({"max_stored_response_bytes": 0}, ValueError, "max_stored_response_bytes=0: must be at"),
    ({"max_in_flight_per_tenant": 0}, ValueError, "max_in_flight_per_tenant=0: must be at"),
    ({"max_keys_per_tenant": "100"}, TypeError, "max_keys_per_tenant='100': must be an int"),
    # The rest.
    ({"require_key": "false"}, TypeError, "require_key='false': must be True or False"),
    ({"www_authenticate": "Bearer\r\nSet-Cookie: x"}, ValueError, "www_authenticate="),
    ({"isolation_level": "SERIALIZABLE"}, ValueError, "isolation_level='SERIALIZABLE': must"),
    ({"atomic": "yes"}, TypeError, "atomic='yes': must be True, False, or a callable"),
    ({"atomic": _async_choice}, TypeError, "an async function; it must be a plain one"),
    ({"replay_value": ""}, ValueError, "replay_value='': not a header value"),
    ({"omitted_replay_header": "x y"}, ValueError, "omitted_replay_header='x y': 'x y' is not"),
    ({"omitted_replay_header": 1}, TypeError, "omitted_replay_header=1: 1 is not a str"),
    (
        {"omitted_replay_header": "Content-Length"},
        ValueError,
        "omitted_replay_header='Content-Length': 'Content-Length' already means something else",
    ),
    (
        {"omitted_replay_header": "idempotent-replayed"},
        ValueError,
        "omitted_replay_header='idempotent-replayed': already one of replay_headers",
    ),
]


@pytest.mark.parametrize(
    ("options", "error", "message"), MISTAKES, ids=[str(m[0])[:48] for m in MISTAKES]
)
def test_a_mistake_is_refused_when_the_configuration_is_made(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        IdempotencyConfig(**options)
    # ...and the same through the middleware, by name, as add_middleware passes it.
    with pytest.raises(error, match=re.escape(message)):
        IdempotencyMiddleware(Starlette(), store=_store(), tenant=_tenant, **options)


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("ttl", "did you mean ttl_seconds"),
        ("lease", "did you mean lease_seconds"),
        ("exempt", "did you mean exempt_paths"),
        ("max_body_size", "did you mean max_body_bytes"),
        ("timeout", r"an option of the store, not of the middleware: PostgresStore\(dsn, time"),
    ],
)
def test_an_unknown_option_is_named_with_the_one_meant(name, suggested):
    with pytest.raises(TypeError, match=f"^{name}=3600: .*{suggested}"):
        IdempotencyMiddleware(Starlette(), store=_store(), tenant=_tenant, **{name: 3600})
    with pytest.raises(TypeError, match=f"^{name}=3600: "):
        IdempotencyConfig(**{name: 3600})


def test_the_store_options_named_are_the_stores():
    parameters = set(inspect.signature(PostgresStore).parameters) - {"dsn_or_pool"}
    assert parameters == STORE_OPTIONS


def test_what_the_options_accept_is_still_accepted():
    config = IdempotencyConfig(
        methods=["POST"],
        required_paths={"/orders", "/webhooks/*"},
        exempt_paths=("/health",),
        lease_seconds=5,  # an int is a number of seconds
        ttl_seconds=3600.0,
        release_statuses=frozenset({409, 503}),
        wait_seconds=0,
        www_authenticate='Bearer realm="api"',
        replay_headers=["Idempotency-Replayed"],
        replay_value="?1",
        omitted_replay_header="Idempotency-Replay",
        isolation_level="serializable",
        atomic=lambda scope: scope["path"] == "/orders",
    )
    assert config.replay_marks == ((b"idempotency-replayed", b"?1"),)
    assert config.omitted_mark == (b"idempotency-replay", b"omitted")
    assert IdempotencyConfig().omitted_mark is None


# -- before any request is served -------------------------------------------------------------

APP_TYPO = """
from starlette.applications import Starlette
from idempotency_asgi import IdempotencyMiddleware, PostgresStore

app = Starlette()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore("postgresql://unused@127.0.0.1:1/unused"),
    tenant=lambda scope: "acme",
    ttl=3600,
)
"""

CONFIG_TYPO = """
from starlette.applications import Starlette
from idempotency_asgi import IdempotencyConfig, IdempotencyMiddleware, PostgresStore

CONFIG = IdempotencyConfig(exempt_paths="/webhooks/*")
app = Starlette()
app.add_middleware(
    IdempotencyMiddleware,
    store=PostgresStore("postgresql://unused@127.0.0.1:1/unused"),
    tenant=lambda scope: "acme",
    config=CONFIG,
)
"""


def _uvicorn(tmp_path: Path, source: str, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app_under_test.py").write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-m", "uvicorn", "app_under_test:app", "--port", "0", *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_typo_in_the_config_at_import_stops_uvicorn_before_it_serves(tmp_path):
    ran = _uvicorn(tmp_path, CONFIG_TYPO)
    assert ran.returncode != 0
    assert "exempt_paths='/webhooks/*': a string" in ran.stderr
    assert "Uvicorn running" not in ran.stderr


def test_with_lifespan_on_an_unknown_option_stops_uvicorn_before_it_serves(tmp_path):
    # Starlette makes its middleware at the first call, the lifespan's startup: with
    # `--lifespan on` a failure there stops the server.
    ran = _uvicorn(tmp_path, APP_TYPO, "--lifespan", "on")
    assert ran.returncode != 0
    assert "ttl=3600: not an option of the middleware" in ran.stderr
    assert "did you mean ttl_seconds?" in ran.stderr
    assert "Application startup failed. Exiting." in ran.stderr
    assert "Uvicorn running" not in ran.stderr


def _store() -> PostgresStore:
    return PostgresStore("postgresql://unused@127.0.0.1:1/unused")


def _tenant(scope: Any) -> str:
    return "acme"
