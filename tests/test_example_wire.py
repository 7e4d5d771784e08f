"""The example over real HTTP: its start commands, a crash mid-request, workers, compose."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from examples.payments.settings import DEFAULT_TOKENS
from tests.helpers import fresh_database, key_row, new_key, running
from tests.server import ROOT, UvicornProcess, free_port

PAYMENT = {"amount": 4200, "currency": "EUR", "customer_id": "cus_wire"}
ACME = {"authorization": "Bearer sk_test_acme"}


def curl_to_request(command: str) -> tuple[str, dict[str, str], str]:
    """The URL, headers and body of one printed `curl` command."""
    words = shlex.split(command)
    assert words[0] == "curl"
    headers, body, url = {}, "", ""
    it = iter(words[1:])
    for word in it:
        if word == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            body = next(it)
        elif word.startswith("http"):
            url = word
    return url, headers, body


def run_pasted(line: str) -> str:
    """A line of the banner, run as a reader would paste it into a shell."""
    assert shutil.which("curl"), "the example's banner is checked with curl: install it"
    found = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    return found.stdout.replace("\r\n", "\n")


def status(answer: str) -> int:
    return int(answer.split()[1])


def body(answer: str) -> str:
    return answer.split("\n\n", 1)[1]


@pytest.mark.slow
def test_scripts_example_serves_on_its_own_postgres(tmp_path):
    """The README's first command as written: it sets itself up and serves."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(
        PORT=str(port),
        PAYMENTS_DATA_DIR=str(tmp_path / "pg"),
        PYTHONUNBUFFERED="1",
        PAYMENTS_FAULT_INJECTION="1",
    )
    process = subprocess.Popen(
        ["scripts/example"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "sleep 1;" in line:  # the banner's last line
                break
        output = "".join(lines)
        # It says what it does before the banner, and no tool's noise comes with it.
        assert output.startswith("Starting a PostgreSQL of its own"), output
        assert "Warning" not in output and "*****" not in output, output
        named = {word for line in lines for word in line.split() if word.startswith("http://")}
        root = f"http://127.0.0.1:{port}"
        assert named == {root, f"{root}/docs", f"{root}/payments"}, output
        # Every address it names answers (the bare one, uvicorn's, leads to the API's page).
        assert httpx.get(root, follow_redirects=True).url == f"{root}/docs"
        assert httpx.get(f"{root}/docs").status_code == 200
        assert httpx.get(f"{root}/payments", headers=ACME).status_code == 200
        curls = [line.strip() for line in lines if line.strip().startswith("curl ")]
        assert len(curls) == 3 and curls[0] == curls[1]  # and the slow one, for the 409
        # Pasted into a shell, as the banner says: a payment, then its replay ...
        first, second = (run_pasted(line) for line in curls[:2])
        assert [status(first), status(second)] == [201, 201]
        assert "idempotent-replayed: true" not in first
        assert "idempotent-replayed: true" in second
        assert body(second) == body(first)
        # ... and a slow one raced by its duplicate: a 409, then the replay, each answer
        # on its own lines.
        raced = run_pasted(curls[2])
        answers = raced.split("HTTP/1.1 ")[1:]
        assert [int(answer[:3]) for answer in answers] == [409, 201], raced
        assert "retry-after: " in answers[0]
        assert answers[0].endswith("}\n") and "idempotent-replayed: true" in answers[1]
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()
    assert code == 0
    # The database it started is stopped again (its data stays for the next start).
    pid_file = tmp_path / "pg" / "postmaster.pid"
    assert not pid_file.exists()
    assert (tmp_path / "pg" / "PG_VERSION").exists()


@pytest.mark.slow
async def test_crash_during_a_payment_then_retry_makes_exactly_one(schema, db):
    env = {
        "DATABASE_URL": schema,
        "PAYMENTS_FAULT_INJECTION": "1",
        "IDEMPOTENCY_LEASE_SECONDS": "1",
    }
    key = new_key()
    first = UvicornProcess("examples.payments.app:app", env).start(ready_path="/healthz")
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
            doomed = asyncio.create_task(
                http.post(
                    "/payments",
                    json=PAYMENT,
                    headers={**ACME, "idempotency-key": key, "x-fault-delay-ms": "5000"},
                )
            )
            await running(db, "acme", key)
            await asyncio.sleep(0.3)  # the payment is written, uncommitted, during the delay
            first.kill()
            with pytest.raises(httpx.TransportError):
                await doomed
    finally:
        first.stop()
    # POST /payments runs in the atomic mode: the transaction was the lease, and PostgreSQL
    # rolled it back when the dead process's connection dropped. Nothing of it persists, and
    # the key is free at once: the first retry after the restart runs (no 409 for a lease).
    assert await key_row(db, "acme", key) is None
    second = UvicornProcess("examples.payments.app:app", env, port=first.port)
    second.start(ready_path="/healthz")
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=30) as http:
            retry = await http.post(
                "/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key}
            )
            replay = await http.post(
                "/payments", json=PAYMENT, headers={**ACME, "idempotency-key": key}
            )
    finally:
        second.stop()
    assert retry.status_code == 201, retry.text
    assert replay.content == retry.content
    payments = await db.fetchval("SELECT count(*) FROM payments WHERE idempotency_key = $1", key)
    events = await db.fetchval("SELECT count(*) FROM outbox WHERE idempotency_key = $1", key)
    assert (payments, events) == (1, 1)


@pytest.mark.slow
async def test_several_uvicorn_workers_bring_a_fresh_schema_up_together(schema):
    async with fresh_database(schema) as url:
        server = UvicornProcess(
            "examples.payments.app:app", {"DATABASE_URL": url}, extra_args=("--workers", "3")
        )
        server.start(ready_path="/healthz", timeout=60)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                responses = [
                    await http.post(
                        "/payments", json=PAYMENT, headers={**ACME, "idempotency-key": new_key()}
                    )
                    for _ in range(6)
                ]
        finally:
            server.stop()
        assert [r.status_code for r in responses] == [201] * 6


def test_compose_yaml_wires_the_example_services_consistently():
    """Read as YAML only (no Docker engine here): services, settings and commands agree."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "api", "worker", "provider", "upstream", "gateway"}
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    url = services["api"]["environment"]["DATABASE_URL"]
    user = postgres["environment"]["POSTGRES_USER"]
    password = postgres["environment"]["POSTGRES_PASSWORD"]
    database = postgres["environment"]["POSTGRES_DB"]
    assert url == f"postgresql://{user}:{password}@postgres:5432/{database}"
    for name in ("api", "worker", "provider"):
        service = services[name]
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert service["environment"]["DATABASE_URL"] == url
        # Fault injection is for tests only.
        assert "PAYMENTS_FAULT_INJECTION" not in service["environment"]
    api = services["api"]
    # Migrations are applied before the API serves.
    command = api["command"]
    assert command.index("idempotency-asgi migrate") < command.index("uvicorn")
    assert "examples.payments.app:app" in command
    assert api["environment"]["PAYMENTS_TOKENS"] == DEFAULT_TOKENS
    assert "examples.payments.worker" in services["worker"]["command"]
    assert services["worker"]["environment"]["PAYMENTS_DOWNSTREAM_URL"] == (
        "http://provider:8001/charges"
    )
    assert "examples.payments.provider" in services["provider"]["command"]
    for name in ("worker", "provider"):
        assert services[name]["depends_on"].get("api", {}).get("condition") in (
            None,
            "service_started",
            "service_healthy",
        )
    # Every module named in a command exists.
    for service in services.values():
        for word in str(service.get("command", "")).replace("&&", " ").split():
            word = word.strip("\"'")
            if word.startswith("examples."):
                module = word.split(":")[0]
                assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists() or (
                    ROOT / Path(*module.split("."))
                ).is_dir(), module
