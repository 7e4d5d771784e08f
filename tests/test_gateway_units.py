"""The gateway's parts on their own: headers, tenants, settings, the CLI, the deadline."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotency_asgi.gateway as gateway_package
from idempotency_asgi.gateway import build_gateway, tenant_from_credential, tenant_from_header
from idempotency_asgi.gateway.deadline import DEADLINE_KEY, ClientDeadline
from idempotency_asgi.gateway.headers import request_headers, response_headers
from idempotency_asgi.gateway.options import OPTIONS
from idempotency_asgi.gateway.problems import still_running
from idempotency_asgi.gateway.settings import Settings
from tests.server import ROOT

MINIMAL_ENV = {
    "IDEMPOTENCY_GATEWAY_UPSTREAM": "http://127.0.0.1:9000",
    "DATABASE_URL": "postgresql://localhost/db",
    "IDEMPOTENCY_GATEWAY_TENANT_HEADER": "X-Consumer-Id",
}


def test_public_names_are_pinned():
    assert gateway_package.__all__ == [
        "DEFAULT_HEALTH_PATH",
        "Gateway",
        "TenantResolver",
        "UpstreamOutcomeUnknown",
        "build_gateway",
        "tenant_from_credential",
        "tenant_from_header",
    ]
    for name in gateway_package.__all__:
        assert getattr(gateway_package, name) is not None
    with pytest.raises(AttributeError):
        gateway_package.nothing_here  # noqa: B018


def test_the_other_commands_do_not_need_the_gateway_extra():
    code = "import sys, idempotency_asgi._cli; assert 'httpx' not in sys.modules, 'httpx loaded'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# -- headers -------------------------------------------------------------------------------


def forward(headers, **options):
    """What the upstream would receive from a client at 10.0.0.9 over plain HTTP."""
    defaults = {"client": ("10.0.0.9", 5555), "scheme": "http"}
    defaults.update(preserve_host=False, trust_forwarded=False)
    return request_headers(headers, **{**defaults, **options})


def test_hop_by_hop_request_headers_and_those_connection_names_are_dropped():
    out = forward(
        [
            (b"host", b"shop.example"),
            (b"connection", b"keep-alive, X-Private"),
            (b"connection", b"x-other"),
            (b"x-private", b"1"),
            (b"x-other", b"2"),
            (b"keep-alive", b"timeout=5"),
            (b"te", b"trailers"),
            (b"trailer", b"x-sum"),
            (b"transfer-encoding", b"chunked"),
            (b"upgrade", b"h2c"),
            (b"proxy-connection", b"keep-alive"),
            (b"proxy-authorization", b"Basic x"),
            (b"proxy-authenticate", b"Basic"),
            (b"expect", b"100-continue"),
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer t"),
        ]
    )
    assert out == [
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer t"),
        (b"x-forwarded-for", b"10.0.0.9"),
        (b"x-forwarded-proto", b"http"),
        (b"x-forwarded-host", b"shop.example"),
    ]


def test_every_proxy_header_is_hop_by_hop_both_ways():
    proxy_headers = [
        (b"proxy-authorization", b"Basic x"),
        (b"proxy-authentication-info", b"nextnonce=1"),
        (b"proxy-foo", b"bar"),
    ]
    out = forward([(b"x-kept", b"1"), *proxy_headers])
    assert [name for name, _ in out if name.startswith(b"proxy")] == []
    assert (b"x-kept", b"1") in out
    answer = [(b"Proxy-Authenticate", b"Basic"), (b"Proxy-Status", b"x"), (b"ETag", b'"e"')]
    assert response_headers(answer) == [(b"etag", b'"e"')]


def test_x_forwarded_for_appends_to_every_earlier_hop():
    out = forward(
        [(b"x-forwarded-for", b"203.0.113.1"), (b"x-forwarded-for", b"198.51.100.2, 10.1.1.1")]
    )
    assert (b"x-forwarded-for", b"203.0.113.1, 198.51.100.2, 10.1.1.1, 10.0.0.9") in out
    assert (b"x-forwarded-for", b"203.0.113.1") not in out


def test_forwarded_proto_and_host_are_replaced_unless_trusted():
    claimed = [(b"host", b"inner"), (b"x-forwarded-proto", b"https"), (b"x-forwarded-host", b"a")]
    replaced = forward(claimed)
    assert (b"x-forwarded-proto", b"http") in replaced
    assert (b"x-forwarded-host", b"inner") in replaced
    trusted = forward(claimed, trust_forwarded=True)
    assert (b"x-forwarded-proto", b"https") in trusted
    assert (b"x-forwarded-host", b"a") in trusted


def test_host_is_the_upstreams_unless_preserved():
    assert all(name != b"host" for name, _ in forward([(b"host", b"shop.example")]))
    preserved = forward([(b"host", b"shop.example")], preserve_host=True)
    assert (b"host", b"shop.example") in preserved


def test_no_client_address_means_no_address_appended():
    assert all(name != b"x-forwarded-for" for name, _ in forward([], client=None))


def test_response_headers_keep_order_repeats_and_values():
    raw = [
        (b"Content-Type", b"text/html; charset=ISO-8859-1"),
        (b"Set-Cookie", b"a=1"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"secret"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Set-Cookie", b"b=2;  Path=/ "),
        (b"ETag", b'W/"x"'),
    ]
    assert response_headers(raw) == [
        (b"content-type", b"text/html; charset=ISO-8859-1"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2;  Path=/ "),
        (b"etag", b'W/"x"'),
    ]


# -- tenants -------------------------------------------------------------------------------


def scope_with(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


def test_tenant_from_a_trusted_header():
    resolve = tenant_from_header("X-Consumer-Id")
    assert resolve(scope_with((b"x-consumer-id", b"acme"))) == "acme"
    assert resolve(scope_with((b"x-consumer-id", b"  "))) is None
    assert resolve(scope_with((b"authorization", b"Bearer x"))) is None


def test_tenant_from_the_credential_is_a_digest_never_the_credential():
    resolve = tenant_from_credential()
    tenant = resolve(scope_with((b"authorization", b"Bearer secret-token")))
    assert tenant == "sha256:" + hashlib.sha256(b"Bearer secret-token").hexdigest()
    assert "secret-token" not in tenant
    assert resolve(scope_with((b"authorization", b"Bearer other"))) != tenant
    assert resolve(scope_with()) is None
    assert resolve(scope_with((b"authorization", b""))) is None
    keyed = tenant_from_credential("X-Api-Key", secret="s3")
    expected = hmac.new(b"s3", b"k1", hashlib.sha256).hexdigest()
    assert keyed(scope_with((b"x-api-key", b"k1"))) == "hmac:" + expected


# -- settings and the command --------------------------------------------------------------


def test_settings_from_the_environment_with_defaults():
    settings = Settings.from_environment(MINIMAL_ENV)
    assert settings.upstream == "http://127.0.0.1:9000"
    assert settings.tenant_header == "X-Consumer-Id"
    assert settings.tenant_from is None
    assert settings.config.methods == ("POST", "PATCH")
    assert settings.client_timeout == 30.0 and settings.upstream_timeout == 120.0
    assert settings.keepalive_expiry == 4.0
    assert settings.apply_schema is True and settings.config.require_key is False
    assert settings.config.max_in_flight_per_tenant is None
    assert Settings.from_environment(settings.environment()) == settings


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"IDEMPOTENCY_GATEWAY_PORT": "eighty"}, "IDEMPOTENCY_GATEWAY_PORT"),
        ({"IDEMPOTENCY_GATEWAY_CLIENT_TIMEOUT": "-1"}, "IDEMPOTENCY_GATEWAY_CLIENT_TIMEOUT"),
        ({"IDEMPOTENCY_GATEWAY_REQUIRE_KEY": "maybe"}, "IDEMPOTENCY_GATEWAY_REQUIRE_KEY"),
        ({"IDEMPOTENCY_GATEWAY_TENANT_FROM": "authorization"}, "one of --tenant-header"),
        ({"IDEMPOTENCY_GATEWAY_CLIENT_TIMEOUT": "300"}, "--client-timeout must not exceed"),
        ({"IDEMPOTENCY_GATEWAY_UPSTREAM": ""}, "no upstream"),
        ({"DATABASE_URL": ""}, "no database"),
        ({"IDEMPOTENCY_GATEWAY_HEALTH_PATH": "health"}, "--health-path"),
        ({"IDEMPOTENCY_GATEWAY_LOG_LEVEL": "bogus"}, "IDEMPOTENCY_GATEWAY_LOG_LEVEL"),
        ({"IDEMPOTENCY_GATEWAY_HTTP": "h2"}, "IDEMPOTENCY_GATEWAY_HTTP: 'h2' is not one of"),
        ({"IDEMPOTENCY_LEASE_SECONDS": "inf"}, "IDEMPOTENCY_LEASE_SECONDS: inf is not a finite"),
        ({"IDEMPOTENCY_TTL_SECONDS": "1e10"}, "IDEMPOTENCY_TTL_SECONDS"),
        ({"IDEMPOTENCY_GATEWAY_WAIT_SECONDS": "nan"}, "IDEMPOTENCY_GATEWAY_WAIT_SECONDS"),
    ],
)
def test_bad_settings_are_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_environment({**MINIMAL_ENV, **extra})


def test_help_documents_every_option_and_its_variable():
    result = subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", "gateway", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(result.stdout.split())
    for option in OPTIONS:
        assert option.flag in text, option.flag
        assert f"[{option.env}]" in text, option.env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--upstream", "http://x:1"], "name the tenant with one of --tenant-header"),
        (["--upstream", "ftp://x", "--tenant-header", "t"], "must be an http:// or https:// URL"),
    ],
)
def test_the_command_refuses_a_bad_configuration_with_usage(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": "postgresql://x/y"},
    )
    assert result.returncode == 2
    assert message in result.stderr


LEVELS = "critical, error, warning, info, debug, trace"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--log-level", "bogus"], {}, f"argument --log-level: 'bogus' is not one of {LEVELS}"),
        (["--log-level", "INFO"], {}, "argument --log-level: 'INFO' is not one of"),
        ([], {"IDEMPOTENCY_GATEWAY_LOG_LEVEL": "bogus"}, "IDEMPOTENCY_GATEWAY_LOG_LEVEL: 'bogus'"),
        (["--lease-seconds", "inf"], {}, "argument --lease-seconds: inf is not a finite number"),
        (["--lease-seconds", "nan"], {}, "argument --lease-seconds: nan is not a finite number"),
        (["--ttl-seconds", "inf"], {}, "argument --ttl-seconds: inf is not a finite number"),
        (["--ttl-seconds", "1e300"], {}, "argument --ttl-seconds: 1e300 is more than 1e9"),
        (["--lease-seconds", "1000000001"], {}, "--lease-seconds: 1000000001 is more than 1e9"),
        (["--client-timeout", "inf"], {}, "argument --client-timeout: inf is not a finite"),
        (["--wait-seconds", "inf"], {}, "argument --wait-seconds: inf is not a finite number"),
        ([], {"IDEMPOTENCY_TTL_SECONDS": "inf"}, "IDEMPOTENCY_TTL_SECONDS: inf is not a finite"),
    ],
)
def test_the_command_refuses_a_bad_value_in_one_line_naming_it(args, env, message):
    """Exit status 2 and a line naming the option, never a traceback or a gateway that starts
    (uvicorn fails late on an unknown log level; PostgreSQL on an infinite interval)."""
    command = [sys.executable, "-m", "idempotency_asgi", "gateway"]
    required = ["--upstream", "http://127.0.0.1:9", "--tenant-header", "t", "--port", "0"]
    result = subprocess.run(
        [*command, *required, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": "postgresql://x/y", **env},
        timeout=60,  # a gateway that started would serve until then
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert message in result.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"client_timeout": 10.0, "upstream_timeout": 5.0}, "client_timeout"),
        ({"health_path": "health"}, "health_path"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_build_gateway_refuses_impossible_options(options, message):
    with pytest.raises(ValueError, match=message):
        build_gateway(
            "http://127.0.0.1:9", store="postgresql://x/y", tenant=lambda s: "t", **options
        )


@pytest.mark.parametrize("upstream", ["ftp://host", "127.0.0.1:9000", "http://h/?q=1"])
def test_build_gateway_refuses_an_upstream_it_cannot_use(upstream):
    with pytest.raises(ValueError, match="upstream"):
        build_gateway(upstream, store="postgresql://x/y", tenant=lambda s: "t")


# -- the client's deadline -----------------------------------------------------------------


async def test_the_deadline_answers_the_client_and_lets_the_request_finish():
    finished = asyncio.Event()
    sent: list[dict[str, object]] = []

    async def slow_app(scope, receive, send):
        scope[DEADLINE_KEY].arm()  # forwarded, as the proxy does
        await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})
        finished.set()

    async def collect(message):
        sent.append(message)

    layer = ClientDeadline(slow_app, seconds=0.05, answer=still_running(0.05, 1))
    await layer({"type": "http"}, None, collect)
    assert finished.is_set()  # the request ran to its end
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [504]
    assert b"upstream-still-running" in sent[1]["body"]


async def test_a_response_that_started_in_time_is_never_interrupted():
    sent: list[dict[str, object]] = []

    async def streaming_app(scope, receive, send):
        scope[DEADLINE_KEY].arm()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b"done"})

    async def collect(message):
        sent.append(message)

    layer = ClientDeadline(streaming_app, seconds=0.05, answer=still_running(0.05, 1))
    await layer({"type": "http"}, None, collect)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
    assert sent[-1]["body"] == b"done"


async def test_a_failure_after_the_deadline_is_logged_not_raised(caplog):
    async def failing_app(scope, receive, send):
        scope[DEADLINE_KEY].arm()
        await asyncio.sleep(0.2)
        raise RuntimeError("upstream exploded")

    async def collect(message):
        pass

    layer = ClientDeadline(failing_app, seconds=0.05, answer=still_running(0.05, 1))
    await layer({"type": "http"}, None, collect)
    assert "after its client's deadline" in caplog.text


async def test_the_deadline_runs_from_forwarding_not_from_arrival():
    """A slow upload (or a wait for the key store) is not the upstream being slow: until the
    proxy forwards the request nothing is running upstream, so no 504 says it goes on."""
    sent: list[dict[str, object]] = []

    async def slow_upload_app(scope, receive, send):
        await asyncio.sleep(0.2)  # reading the body, four deadlines long
        scope[DEADLINE_KEY].arm()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made"})

    async def collect(message):
        sent.append(message)

    layer = ClientDeadline(slow_upload_app, seconds=0.05, answer=still_running(0.05, 1))
    await layer({"type": "http"}, None, collect)
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [201]
    assert sent[-1]["body"] == b"made"


async def test_a_failure_before_the_deadline_is_raised():
    async def failing_app(scope, receive, send):
        raise RuntimeError("at once")

    async def collect(message):
        pass

    layer = ClientDeadline(failing_app, seconds=5, answer=still_running(5, 1))
    with pytest.raises(RuntimeError, match="at once"):
        await layer({"type": "http"}, None, collect)


# -- the proxy without an upstream -----------------------------------------------------------


async def test_an_unreachable_upstream_is_a_502_for_every_method():
    from tests.server import free_port

    app = build_gateway(
        f"http://127.0.0.1:{free_port()}",
        store="postgresql://127.0.0.1:1/none",
        tenant=lambda scope: "t",
        apply_schema=False,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://g"
    ) as http:
        for method in ("GET", "DELETE", "PUT"):
            response = await http.request(method, "/anything")
            assert response.status_code == 502, method
            assert response.json()["type"] == "urn:idempotency-asgi:problem:upstream-unavailable"
    await app.proxy.aclose()


@pytest.mark.parametrize(
    ("path", "form"),
    [
        ("/orders", "/orders"),
        ("/Orders/", "/orders"),
        ("//orders//7/", "/orders/7"),
        ("/orders;jsessionid=1/7;v=2", "/orders/7"),
        ("\\orders\\7", "/orders/7"),
        ("/", "/"),
    ],
)
def test_the_loose_form_of_a_path(path, form):
    from idempotency_asgi.gateway.paths import LoosePaths, loose

    assert loose(path) == form
    # `/orders/*` covers `/orders/` as sent, so `/orders` in the loose form too.
    assert LoosePaths(["/orders/*"]).matches(path) is (form + "/").startswith("/orders/")
    assert LoosePaths(["/Orders"]).matches(path) is (form == "/orders")


class _Counted:
    """A compiled pattern whose searches are counted."""

    def __init__(self, pattern: Any) -> None:
        self.pattern = pattern
        self.searches = 0

    def search(self, *args: Any) -> Any:
        self.searches += 1
        return self.pattern.search(*args)


@pytest.mark.parametrize("ending", [b"\r\n\r\n", b"\n\n"], ids=["crlf", "lf"])
def test_a_clean_answer_head_is_checked_whole_not_field_by_field(monkeypatch, ending):
    """The head as the connection reads it (up to its empty line, the last line's CR kept
    with a CRLF ending): with no unsafe byte in it, no value is searched one by one. (The
    last line's CR counted as a bare one, so every head took the slow path.)"""
    from idempotency_asgi.gateway import answers
    from idempotency_asgi.gateway.connection import UpstreamConnection

    counted = _Counted(answers.CONTROL)
    monkeypatch.setattr(answers, "CONTROL", counted)
    lines = [b"HTTP/1.1 200 OK", b"A: b", b"Content-Length: 0"]
    raw = ending[: len(ending) // 2].join(lines) + ending
    head = asyncio.run(_head_as_read(UpstreamConnection, raw))
    assert head.invalid is None and head.headers == [(b"A", b"b"), (b"Content-Length", b"0")]
    assert counted.searches == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nA: b\rc\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nA: b\r\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nA: b\x01\r\n\r\n",
    ],
    ids=["bare-cr", "bare-cr-last", "control"],
)
def test_a_control_character_in_an_answer_head_still_makes_it_invalid(raw):
    from idempotency_asgi.gateway.connection import UpstreamConnection

    head = asyncio.run(_head_as_read(UpstreamConnection, raw))
    assert head.invalid is not None and "control character" in head.invalid


async def _head_as_read(connection_type: Any, raw: bytes) -> Any:
    """`raw` parsed as an UpstreamConnection reads a head off its socket."""
    from idempotency_asgi.gateway.answers import parse_head

    class Stream:
        async def read(self, size: int, timeout: float | None = None) -> bytes:
            data, self.data = self.data, b""
            return data

    stream = Stream()
    stream.data = raw  # type: ignore[attr-defined]
    connection = connection_type(stream, keepalive_expiry=1.0)
    return parse_head(await connection._read_head(None), head_request=False)


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


@pytest.mark.parametrize("hard", [None, 512], ids=["hard-limit-high", "hard-limit-low"])
def test_the_gateway_raises_its_open_files_limit_to_the_hard_limit(schema, tmp_path, hard):
    """Started with a soft limit of 256 open files (1,024 is common), the command's worker
    raises it to the hard limit: 1,000 client connections, their temporary files and 100
    upstream connections need more. When the hard limit is still below that, it says so."""
    import resource

    from tests.gateway_support import GatewayProcess

    _, current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if current_hard != resource.RLIM_INFINITY and current_hard < 4096:
        pytest.skip(f"the hard limit here is {current_hard}")
    limit_hard = current_hard if hard is None else hard

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, limit_hard))

    log = tmp_path / "stderr"
    with log.open("wb") as stderr:
        gateway = GatewayProcess("http://127.0.0.1:9", schema, "--tenant-header", "x-tenant")
        gateway.start(preexec_fn=low_soft_limit, stderr=stderr)
        try:
            soft, _ = _open_files_limit(gateway.pid)
        finally:
            gateway.stop()
    said = log.read_text()
    if hard is None:
        assert soft == (current_hard if current_hard != resource.RLIM_INFINITY else 3164)
        assert "open files are limited" not in said
    else:
        assert soft == 512
        assert "open files are limited to 512 per worker" in said
        assert "may need 3164" in said
