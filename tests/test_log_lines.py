"""The middleware's line per request can be seen where a reader looks: under plain uvicorn,
the two lines of docs/operations.md ("Seeing the log lines") show `idempotency outcome=...`
beside uvicorn's own, in Getting started's application and in the example service. Without
them only WARNING and above reach the terminal, and the line never appears."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.helpers import fresh_database, new_key
from tests.server import ROOT, free_port

QUICKSTART = ROOT / "docs" / "snippets" / "quickstart.py"
ACME = {"authorization": "Bearer sk_test_acme"}


@contextmanager
def serving(command: list[str], cwd: Path, env: dict[str, str], port: int) -> Iterator[Path]:
    """The command, serving on `port`; yields the file its output goes to."""
    log = cwd / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                    break
                except httpx.TransportError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(log.read_text()) from None
                    time.sleep(0.2)
            yield log
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def shown(log: Path, text: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_getting_started_app_shows_a_line_per_request(schema, tmp_path):
    shutil.copy(QUICKSTART, tmp_path / "quickstart.py")
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "quickstart:app", "--port", str(port)]
    with serving(command, tmp_path, {"DATABASE_URL": schema}, port) as log:
        headers = {**ACME, "idempotency-key": new_key()}
        url = f"http://127.0.0.1:{port}/orders"
        first = httpx.post(url, json={"sku-1": 2}, headers=headers, timeout=10)
        again = httpx.post(url, json={"sku-1": 2}, headers=headers, timeout=10)
        assert first.status_code == again.status_code == 201
        assert shown(log, "INFO: idempotency outcome=new case=new tenant=acme"), log.read_text()
        assert shown(log, "INFO: idempotency outcome=replay case=replayed tenant=acme")
        assert "Uvicorn running on" in log.read_text()  # uvicorn's own lines are still there


def test_without_the_two_lines_nothing_shows_them(schema, tmp_path):
    source = QUICKSTART.read_text()
    lines = [line for line in source.splitlines() if not line.startswith("logging.")]
    assert len(lines) == len(source.splitlines()) - 2
    (tmp_path / "quickstart.py").write_text("\n".join(lines) + "\n")
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "quickstart:app", "--port", str(port)]
    with serving(command, tmp_path, {"DATABASE_URL": schema}, port) as log:
        headers = {**ACME, "idempotency-key": new_key()}
        answer = httpx.post(f"http://127.0.0.1:{port}/orders", json={}, headers=headers, timeout=10)
        assert answer.status_code == 201
        assert not shown(log, "idempotency outcome=", seconds=2.0)


async def test_the_example_shows_a_line_per_request(schema, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "examples.payments"]
    payment = {"amount": 1250, "currency": "EUR", "customer_id": "cus_42"}
    async with fresh_database(schema) as dsn:
        env = {"DATABASE_URL": dsn, "PORT": str(port), "PYTHONPATH": str(ROOT)}
        with serving(command, tmp_path, env, port) as log:
            headers = {**ACME, "idempotency-key": new_key()}
            url = f"http://127.0.0.1:{port}/payments"
            async with httpx.AsyncClient(timeout=10) as http:
                first = await http.post(url, json=payment, headers=headers)
                again = await http.post(url, json=payment, headers=headers)
            assert first.status_code == again.status_code == 201, first.text
            assert shown(log, "INFO: idempotency outcome=new case=new tenant=acme")
            assert shown(log, "INFO: idempotency outcome=replay case=replayed tenant=acme")
