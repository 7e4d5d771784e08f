"""`idempotency-asgi verify` against real services over real HTTP: the example payments API
and the gateway pass; services broken one way each fail on the property they break."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_asgi.verify import Report, Status, Target, VerifyError, verify
from tests.gateway_support import GatewayProcess, NodeUpstream
from tests.server import ROOT, UvicornProcess, free_port
from tests.verify_apps import MARKER, limited, memory_app, refusing

PROPERTIES = [
    "replay-identical",
    "replay-marked",
    "changed-body-422",
    "concurrent-one-execution",
    "missing-key",
    "other-credential-independent",
    "retry-after-on-409",
]
PAYMENT = '{"amount": 100, "currency": "EUR", "customer_id": "c1"}'
ACME = ("Authorization", "Bearer sk_test_acme")
GLOBEX = ("Authorization", "Bearer sk_test_globex")
ORDER = '{"sku": "{unique}", "quantity": 1}'


def statuses(report: Report) -> dict[str, str]:
    return {finding.name: finding.status.value for finding in report.findings}


def failed(report: Report) -> set[str]:
    return set(report.failed())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", "verify", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
    )


@pytest.fixture(scope="module")
def payments(schema: str) -> Iterator[UvicornProcess]:
    env = {"DATABASE_URL": schema, "PAYMENTS_FAULT_INJECTION": "1"}
    server = UvicornProcess("examples.payments.app:app", env).start(ready_path="/healthz")
    yield server
    server.stop()


def payments_target(server: UvicornProcess, **options: object) -> Target:
    settings: dict[str, object] = {
        "headers": (ACME,),
        "other_headers": (GLOBEX,),
        "slow_headers": (("X-Fault-Delay-Ms", "1500"),),
        "body": PAYMENT,
        **options,
    }
    return Target(server.url + "/payments", **settings)  # type: ignore[arg-type]


def keys_answered(report: Report, *, other: bool) -> set[str]:
    """The keys of the requests that got 2xx, for the first credential or the other."""
    return {
        exchange.key
        for finding in report.findings
        for exchange in finding.exchanges
        if exchange.key is not None
        and exchange.status is not None
        and 200 <= exchange.status < 300
        and (exchange.label == "other credential, same key") == other
    }


@pytest.mark.slow
async def test_the_example_payments_api_passes_every_property(payments, db):
    report = await verify(payments_target(payments))
    assert statuses(report) == dict.fromkeys(PROPERTIES, "passed"), report.text()
    assert report.exit_status == 0
    # Judged from the answers; audited in the database: one payment per key that got a 2xx,
    # none for the key reused with the changed body beyond its first one.
    for tenant, other in (("acme", False), ("globex", True)):
        keys = keys_answered(report, other=other)
        rows = await db.fetch(
            "SELECT idempotency_key, count(*) AS n FROM payments"
            " WHERE tenant_id = $1 AND idempotency_key = ANY($2::text[])"
            " GROUP BY idempotency_key",
            tenant,
            sorted(keys),
        )
        assert {row["idempotency_key"]: row["n"] for row in rows} == dict.fromkeys(keys, 1)
    changed = report.finding("changed-body-422")
    reused = changed.exchanges[0].key
    assert changed.exchanges[1].key == reused and changed.exchanges[1].status == 422
    assert (
        await db.fetchval("SELECT amount FROM payments WHERE idempotency_key = $1", reused) == 100
    )
    concurrent = report.finding("concurrent-one-execution")
    assert concurrent.summary.startswith("one execution: 1 original (201)")


@pytest.mark.slow
async def test_without_a_slow_route_retry_after_is_unobserved_not_failed(payments):
    report = await verify(payments_target(payments, slow_headers=(), other_headers=None))
    finding = report.finding("retry-after-on-409")
    if finding.status is Status.PASSED:
        # The concurrent duplicates overlapped the first payment after all (a busy machine):
        # that is a real 409, really carrying Retry-After.
        assert "409s: " in finding.evidence[0]
    else:
        assert finding.status is Status.UNOBSERVED
        assert "--slow-header" in finding.summary
    assert report.finding("other-credential-independent").status is Status.SKIPPED
    assert report.exit_status == 0


@pytest.mark.slow
def test_the_command_prints_json_for_ci(payments):
    result = cli(
        payments.url + "/payments",
        "-H",
        "Authorization: Bearer sk_test_acme",
        "--other-header",
        "Authorization: Bearer sk_test_globex",
        "--slow-header",
        "X-Fault-Delay-Ms: 1500",
        "--body",
        PAYMENT,
        "--concurrency",
        "6",
        "--json",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["passed"] is True and document["exit_status"] == 0
    assert document["target"]["concurrency"] == 6
    # Header values stay out of the report (credentials, tokens): only their names are in it.
    assert "Bearer" not in json.dumps(document["target"])
    assert "1500" not in json.dumps(document["target"])
    assert document["target"]["slow_header_names"] == ["X-Fault-Delay-Ms"]
    by_name = {item["name"]: item for item in document["properties"]}
    assert list(by_name) == PROPERTIES
    assert {item["status"] for item in by_name.values()} == {"passed"}
    assert by_name["replay-marked"]["source"] == "idempotency-asgi"
    assert by_name["changed-body-422"]["source"] == "draft"
    duplicates = by_name["concurrent-one-execution"]["exchanges"]
    assert len(duplicates) == 7  # six at once, and one retry after they all answered
    assert len({d["body_sha256"] for d in duplicates if d["status"] != 409}) == 1


@pytest.mark.slow
def test_the_text_report_is_one_line_per_property(payments):
    result = cli(
        payments.url + "/payments",
        "-H",
        "Authorization: Bearer sk_test_acme",
        "--body",
        PAYMENT,
        "--slow-header",
        "X-Fault-Delay-Ms: 1500",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    heads = [line.split()[:2] for line in lines if not line.startswith(" ")][1:-1]
    assert [name for _, name in heads] == PROPERTIES
    assert dict((name, status) for status, name in heads) == {
        **dict.fromkeys(PROPERTIES, "PASSED"),
        "other-credential-independent": "SKIPPED",
    }
    assert lines[-1] == "6 passed, 0 failed, 0 unobserved, 1 skipped: no property failed"


@pytest.mark.slow
def test_a_route_that_refuses_the_request_is_a_usage_error(payments):
    result = cli(payments.url + "/payments", "--body", PAYMENT)  # no credential: 401
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert "answered 401 to a new keyed request" in result.stderr


@pytest.mark.slow
async def test_the_gateway_in_front_of_the_node_service_passes(schema):
    node = NodeUpstream().start()
    gateway = GatewayProcess(node.url, schema, "--tenant-from", "authorization")
    try:
        gateway.start()
        target = Target(
            gateway.url + "/orders",
            headers=(("Authorization", "Bearer verify-a"),),
            other_headers=(("Authorization", "Bearer verify-b"),),
            slow_headers=(("X-Delay-Ms", "1500"),),
            body=ORDER,
            key_required=False,  # the gateway passes a request without a key straight through
        )
        report = await verify(target)
        assert statuses(report) == dict.fromkeys(PROPERTIES, "passed"), report.text()
        # The service itself is not idempotent: its counts say how often each key ran.
        other = keys_answered(report, other=True)
        for key in keys_answered(report, other=False):
            assert node.created(key) == (2 if key in other else 1), key
        duplicates = report.finding("concurrent-one-execution").exchanges
        assert node.counts(duplicates[0].key or "") == {"created": 1, "deliveries": 1}
    finally:
        gateway.stop()
        node.stop()


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[str]:
    server = UvicornProcess(f"tests.verify_apps:{request.param}", {}).start()
    yield server.url + "/orders"
    server.stop()


def order_target(url: str, **options: object) -> Target:
    settings: dict[str, object] = {"body": ORDER, "slow_headers": (("X-Delay-Ms", "1000"),)}
    return Target(url, **{**settings, **options})  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("served", ["no_idempotency"], indirect=True)
def test_a_service_that_runs_duplicates_twice_fails_by_name(served):
    result = cli(served, "--body", ORDER, "--slow-header", "X-Delay-Ms: 500")
    assert result.returncode == 1
    heads = {
        line.split()[1]: line.split()[0]
        for line in result.stdout.splitlines()[1:-1]
        if not line.startswith(" ")
    }
    assert heads["concurrent-one-execution"] == "FAILED"
    assert heads["replay-identical"] == "FAILED"
    assert heads["changed-body-422"] == "FAILED"
    assert heads["missing-key"] == "FAILED"
    assert result.stdout.splitlines()[-1].startswith("0 passed, ")
    assert "concurrent-one-execution" in result.stdout.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("served", ["no_idempotency"], indirect=True)
async def test_duplicates_that_run_twice_are_named_with_their_evidence(served):
    report = await verify(order_target(served, concurrency=5))
    concurrent = report.finding("concurrent-one-execution")
    assert concurrent.status is Status.FAILED
    assert "different answers among 5" in concurrent.summary
    assert "ran more than once" in concurrent.summary
    assert "the changed request ran as a new one" in report.finding("changed-body-422").summary
    assert "201 without a key, expected 400" in report.finding("missing-key").summary
    # Every duplicate ran, so none overlapped as a 409: not observable, not failed.
    retry_after = report.finding("retry-after-on-409")
    assert retry_after.status is Status.UNOBSERVED
    assert "got an answer of its own (201), not 409" in retry_after.summary
    assert report.exit_status == 1


@pytest.mark.slow
@pytest.mark.parametrize("served", ["unstable_replays"], indirect=True)
async def test_replays_that_differ_from_the_original_fail(served):
    report = await verify(order_target(served))
    assert failed(report) == {"replay-identical", "concurrent-one-execution"}, report.text()
    summary = report.finding("replay-identical").summary
    assert summary.startswith("the retry got another answer: bodies part at byte")
    # It ran once (one answer without the marker): the summary names the replays, not a rerun.
    concurrent = report.finding("concurrent-one-execution").summary
    assert "replays are not byte-identical to the original" in concurrent, concurrent
    assert "ran more than once" not in concurrent
    assert report.finding("replay-marked").status is Status.PASSED
    assert report.finding("retry-after-on-409").status is Status.PASSED


@pytest.mark.slow
@pytest.mark.parametrize("served", ["ignores_body"], indirect=True)
async def test_a_service_that_ignores_the_body_fails_only_the_422(served):
    report = await verify(order_target(served))
    assert failed(report) == {"changed-body-422"}, report.text()
    summary = report.finding("changed-body-422").summary
    assert "was replayed for a different body" in summary
    assert report.exit_status == 1


@pytest.mark.slow
@pytest.mark.parametrize("served", ["draft_only"], indirect=True)
async def test_a_draft_service_with_no_marker_passes_the_draft(served):
    strict = await verify(order_target(served))
    # Only our own marker is missing: every property of the draft holds.
    assert failed(strict) == {"replay-marked"}, strict.text()
    assert "no Idempotent-Replayed: true on the retry" in strict.finding("replay-marked").summary
    relaxed = await verify(order_target(served, replay_marker=None))
    assert relaxed.exit_status == 0, relaxed.text()
    assert statuses(relaxed)["replay-marked"] == "skipped"
    assert statuses(relaxed)["concurrent-one-execution"] == "passed"


async def test_in_process_through_an_asgi_transport():
    transport = httpx.ASGITransport(app=memory_app())
    report = await verify(order_target("http://test/orders"), transport=transport)
    assert statuses(report) == {
        **dict.fromkeys(PROPERTIES, "passed"),
        "other-credential-independent": "skipped",
    }, report.text()


async def test_an_unreachable_service_raises_verify_error():
    with pytest.raises(VerifyError, match="cannot reach"):
        await verify(order_target(f"http://127.0.0.1:{free_port()}/orders"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ftp://example.com/x"], "'ftp://example.com/x' is not an http:// or https:// URL"),
        (["http://127.0.0.1:99999/x"], "Port out of range"),
        (["http://127.0.0.1:1/x", "--concurrency", "1"], "concurrency must be at least 2"),
    ],
)
def test_bad_values_exit_2_with_one_line(args, message):
    result = cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("idempotency-asgi verify: ")
    assert message in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-H", "no colon"], "-H/--header: 'no colon' is not a header: write it as 'Name: value'"),
        (["-H", "X(bad): v"], "-H/--header: 'X(bad)' is not a header name (RFC 9110 token:"),
        (["--other-header", "X Note: v"], "--other-header: 'X Note' is not a header name"),
        (["--slow-header", "Dé: 1"], "--slow-header: 'Dé' is not a header name"),
        (["--replay-marker", "Re(played): 1"], "--replay-marker: 'Re(played)' is not a header"),
        (["-H", "X-Note: a\x01b"], "-H/--header: X-Note: the value holds a control character"),
        (["-H", "X-Note: a\rb"], "-H/--header: X-Note: the value holds a control character"),
        (["-H", "Idempotency-Key: k"], "-H/--header: Idempotency-Key is verify's own"),
        (["--other-header", "idempotency-key: k"], "--other-header: idempotency-key is verify's"),
        (["--slow-header", "IDEMPOTENCY-KEY: k"], "--slow-header: IDEMPOTENCY-KEY is verify's"),
        (["-H", "Content-Length: 3"], "-H/--header: Content-Length is verify's own"),
    ],
)
def test_a_header_verify_cannot_send_is_a_usage_error_naming_its_option(args, message):
    # The URL cannot be reached: a header that got past the parse would say so instead.
    result = cli("http://127.0.0.1:1/x", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"idempotency-asgi verify: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"headers": (("X(bad)", "v"),)}, "headers: 'X(bad)' is not a header name"),
        ({"headers": (("X-Note", "a\nb"),)}, "headers: X-Note: the value holds a control"),
        ({"headers": (("X-Note", " v"),)}, "headers: X-Note: the value starts or ends with"),
        ({"headers": (("X-Note", "\ud800"),)}, "headers: X-Note: the value is not text"),
        ({"other_headers": (("Idempotency-Key", "k"),)}, "other_headers: Idempotency-Key is"),
        ({"slow_headers": (("Transfer-Encoding", "chunked"),)}, "slow_headers: Transfer-Enc"),
        ({"replay_marker": ("Re(played)", "1")}, "replay_marker: 'Re(played)' is not a header"),
    ],
)
def test_a_target_refuses_headers_it_cannot_send(options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        Target("http://x/orders", **options)


def remembering(app: ASGIApp, seen: list[dict[bytes, bytes]]) -> ASGIApp:
    """`app`, keeping the headers of every request as they arrived."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(dict(scope["headers"]))
        await app(scope, receive, send)

    return wrapped


IN_PROCESS = "http://test/orders"


async def in_process(app: ASGIApp, **options: object) -> Report:
    return await verify(order_target(IN_PROCESS, **options), transport=httpx.ASGITransport(app))


async def test_header_values_are_sent_as_the_bytes_typed():
    """UTF-8, as curl sends them; bytes the shell passed that are not UTF-8 (which Python
    holds as surrogate escapes) go out as they came."""
    seen: list[dict[bytes, bytes]] = []
    report = await in_process(
        remembering(memory_app(), seen),
        headers=(("X-Note", "café"), ("X-Raw", "caf\udce9")),
        slow_headers=(("X-Delay-Ms", "1000"), ("X-Why", "naïve")),
    )
    assert report.exit_status == 0, report.text()
    assert {request[b"x-note"] for request in seen} == {"café".encode()}
    assert {request[b"x-raw"] for request in seen} == {b"caf\xe9"}
    assert {request.get(b"x-why") for request in seen} == {None, "naïve".encode()}


@pytest.mark.slow
@pytest.mark.parametrize("served", ["draft_only"], indirect=True)
def test_the_command_sends_header_values_that_are_not_ascii(served):
    result = cli(
        served,
        "--body",
        ORDER,
        "--replay-marker",
        "none",
        "-H",
        "X-Note: café",
        "-H",
        "X-Raw: caf\udce9",  # the byte 0xe9 in argv, not UTF-8
        "--slow-header",
        "X-Delay-Ms: 500",
        "--slow-header",
        "X-Why: naïve",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""


def test_the_report_names_header_options_without_their_values():
    target = Target(
        "http://x/p",
        headers=(ACME,),
        other_headers=(GLOBEX,),
        slow_headers=(("X-Debug-Token", "SECRET-123"),),
    )
    described = json.dumps(target.describe())
    assert "SECRET-123" not in described and "Bearer" not in described
    assert target.describe()["header_names"] == ["Authorization"]
    assert target.describe()["slow_header_names"] == ["X-Debug-Token"]


@pytest.mark.parametrize("status", [400, 404, 429, 401])
async def test_another_credential_that_is_refused_is_unobserved_not_passed(status):
    app = refusing(memory_app(), "Bearer other", status)
    report = await in_process(app, other_headers=(("Authorization", "Bearer other"),))
    finding = report.finding("other-credential-independent")
    assert finding.status is Status.UNOBSERVED, report.text()
    assert finding.summary.startswith(f"the other credential was refused ({status}"), finding
    assert f"-> {status}," in finding.evidence[1]
    assert report.exit_status == 0


async def test_another_credentials_same_key_runs_on_its_own():
    report = await in_process(memory_app(), headers=(ACME,), other_headers=(GLOBEX,))
    assert statuses(report) == dict.fromkeys(PROPERTIES, "passed"), report.text()
    summary = report.finding("other-credential-independent").summary
    assert summary == "ran on its own: 201, not the first credential's answer"


@pytest.mark.parametrize("marker", [MARKER, None])
async def test_a_key_shared_across_credentials_fails(marker):
    app = memory_app(per_credential=False, marker=marker)
    report = await in_process(app, headers=(ACME,), other_headers=(GLOBEX,), replay_marker=marker)
    assert failed(report) == {"other-credential-independent"}, report.text()
    summary = report.finding("other-credential-independent").summary
    assert summary.startswith("marked as a replay" if marker else "byte-identical")


async def test_the_same_bytes_for_another_credential_pass_only_when_the_marker_says_so():
    """A route that answers alike for the same input: with the replay marker seen on the
    retry, an unmarked answer ran on its own whatever its bytes; without one, identical bytes
    are all there is to judge by, and they look like a replay."""
    alike = b'{"ok": true}'
    marked = await in_process(memory_app(answer=alike), other_headers=(GLOBEX,))
    finding = marked.finding("other-credential-independent")
    assert finding.status is Status.PASSED, marked.text()
    assert "the same bytes but not marked" in finding.summary
    unmarked = await in_process(
        memory_app(answer=alike, marker=None), other_headers=(GLOBEX,), replay_marker=None
    )
    finding = unmarked.finding("other-credential-independent")
    assert finding.status is Status.FAILED, unmarked.text()
    assert finding.summary.startswith("byte-identical to the first credential's answer")


async def test_replays_that_differ_are_named_not_taken_for_a_second_execution():
    report = await in_process(memory_app(stable_replays=False))
    concurrent = report.finding("concurrent-one-execution")
    assert concurrent.status is Status.FAILED, report.text()
    assert concurrent.summary.startswith(
        "one execution, but 9 of 9 replays are not byte-identical to the original: bodies part"
    ), concurrent.summary


@pytest.mark.parametrize("marker", [MARKER, None])
async def test_a_burst_refused_with_429_is_named_as_such(marker):
    app = limited(memory_app(marker=marker), per_key=3)
    report = await in_process(app, replay_marker=marker)
    concurrent = report.finding("concurrent-one-execution")
    assert concurrent.status is Status.FAILED, report.text()
    assert concurrent.summary.startswith("7 of 10 refused (429 x7)"), concurrent.summary
    assert "rate limited" in concurrent.summary
    assert "ran more than once" not in concurrent.summary


async def test_draft_only_reports_our_properties_without_requiring_them():
    app = memory_app(marker=None, retry_after=False)
    report = await in_process(app, draft_only=True)
    assert failed(report) == set(), report.text()
    assert report.exit_status == 0
    assert statuses(report)["replay-marked"] == "failed"
    assert statuses(report)["retry-after-on-409"] == "failed"
    document = report.to_json()
    assert document["passed"] is True and document["target"]["draft_only"] is True
    required = {item["name"]: item["required"] for item in document["properties"]}
    assert required == {
        **dict.fromkeys(PROPERTIES, True),
        "replay-marked": False,
        "retry-after-on-409": False,
    }
    strict = await in_process(app)
    assert failed(strict) == {"replay-marked", "retry-after-on-409"}, strict.text()
    assert strict.exit_status == 1


@pytest.mark.slow
@pytest.mark.parametrize("served", ["draft_no_retry_after"], indirect=True)
def test_draft_only_lets_a_draft_service_pass_without_our_extras(served):
    """No replay marker and no Retry-After on its 409s: every property of the draft holds."""
    args = (served, "--body", ORDER, "--slow-header", "X-Delay-Ms: 1000")
    assert cli(*args).returncode == 1
    without_marker = cli(*args, "--replay-marker", "none")
    assert without_marker.returncode == 1, without_marker.stdout
    assert without_marker.stdout.splitlines()[-1].endswith("FAILED: retry-after-on-409")
    result = cli(*args, "--draft-only")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "judged by the draft alone" in lines[0]
    heads = {line.split()[1]: line for line in lines[1:-1] if not line.startswith(" ")}
    for name in ("replay-marked", "retry-after-on-409"):
        assert heads[name].startswith("FAILED "), heads[name]
        assert "[idempotency-asgi, not required]" in heads[name]
    assert lines[-1] == (
        "4 passed, 2 failed, 0 unobserved, 1 skipped: no required property failed "
        "(failed, not required: replay-marked, retry-after-on-409)"
    )


def test_an_unreachable_service_exits_2_with_one_line():
    result = cli(f"http://127.0.0.1:{free_port()}/orders", "--body", "{}")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("idempotency-asgi verify: cannot reach http://127.0.0.1:")
    assert len(result.stderr.splitlines()) == 1


def test_the_changed_body_is_derived_from_the_template():
    with_placeholder = Target("http://x/orders", body=ORDER)
    body, how = with_placeholder.changed("v1") or (b"", "")
    assert body != with_placeholder.render("v1") and how.startswith("{unique} = v")
    payment = Target("http://x/payments", body=PAYMENT)
    body, how = payment.changed("v1") or (b"", "")
    assert json.loads(body) == {"amount": 101, "currency": "EUR", "customer_id": "c1"}
    assert how == '"amount": 100 -> 101'
    given = Target("http://x/p", body=PAYMENT, changed_body='{"amount": 5, "id": "{unique}"}')
    assert given.changed("v9") == (
        b'{"amount": 5, "id": "v9"}',
        "the body given as the changed body",
    )
    assert Target("http://x/p", body="plain text").changed("v1") is None
    # JSON bodies get a Content-Type unless one is given; the key goes last, quoted on request.
    assert payment.request_headers("k") == (
        ("Content-Type", "application/json"),
        ("Idempotency-Key", "k"),
    )
    quoted = Target("http://x/p", body="a=1", quote_key=True, headers=(ACME,))
    assert quoted.request_headers("k") == (ACME, ("Idempotency-Key", '"k"'))


def test_the_help_offers_draft_only():
    result = cli("--help")
    assert result.returncode == 0
    assert "--draft-only" in result.stdout
    assert "not required" in " ".join(result.stdout.split())


def test_key_required_is_the_default_and_key_optional_turns_it_off():
    from idempotency_asgi._cli import _parser

    assert _parser().parse_args(["verify", "http://x/p"]).key_required is True
    assert _parser().parse_args(["verify", "http://x/p", "--key-optional"]).key_required is False
    with pytest.raises(SystemExit):
        _parser().parse_args(["verify", "http://x/p", "--key-optional", "--key-required"])


@pytest.mark.slow
async def test_a_server_that_holds_duplicates_leaves_retry_after_unobserved(schema, db):
    """Our own middleware with `wait_seconds`: a duplicate in flight waits for the first
    request's answer instead of taking a 409. Nothing to judge Retry-After on; nothing fails."""
    env = {
        "DATABASE_URL": schema,
        "TEST_APP_SERVE": "1",
        "TEST_APP_OPTIONS": json.dumps({"wait_seconds": 5}),
    }
    server = UvicornProcess("tests.apps:app", env).start()
    try:
        target = Target(
            server.url + "/tx/charge",
            headers=(("X-Tenant", "verify-wait"),),
            other_headers=(("X-Tenant", "verify-wait-other"),),
            slow_headers=(("X-Delay-Ms", "1000"),),
            body='{"charge": "{unique}"}',
            concurrency=4,
        )
        report = await verify(target)
    finally:
        server.stop()
    finding = report.finding("retry-after-on-409")
    if finding.status is Status.PASSED:  # a wait that ran out on a very busy machine: a 409
        assert "409s: " in finding.evidence[0]
    else:
        assert finding.status is Status.UNOBSERVED, report.text()
        assert "got the first's answer once it finished" in finding.summary
    assert report.exit_status == 0, report.text()
    keys = keys_answered(report, other=False)
    rows = await db.fetch(
        "SELECT idempotency_key, count(*) AS n FROM effects"
        " WHERE tenant = 'verify-wait' AND idempotency_key = ANY($1::text[])"
        " GROUP BY idempotency_key",
        sorted(keys),
    )
    assert {row["idempotency_key"]: row["n"] for row in rows} == dict.fromkeys(keys, 1)
