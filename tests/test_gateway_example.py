"""The example (`python -m examples.gateway`), several workers, and docker-compose."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.gateway_support import GatewayProcess, NodeUpstream
from tests.helpers import fresh_database, headers, new_key
from tests.server import ROOT, free_port
from tests.test_example_wire import curl_to_request


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_python_m_examples_gateway_runs_and_stops_everything():
    port, upstream_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(PORT=str(port), UPSTREAM_PORT=str(upstream_port), PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "examples.gateway"],
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
            if "Uvicorn running on" in line or "Application startup complete" in line:
                break
        curls = [line.strip() for line in lines if line.strip().startswith("curl ")]
        direct, keyed = curls[0], curls[2]
        assert curls[0] == curls[1] and curls[2] == curls[3]
        url, request_headers, body = curl_to_request(direct)
        assert (
            httpx.post(url, headers=request_headers, content=body).json()["id"]
            != (httpx.post(url, headers=request_headers, content=body).json()["id"])
        )  # the upstream alone makes two orders
        url, request_headers, body = curl_to_request(keyed)
        first = httpx.post(url, headers=request_headers, content=body)
        second = httpx.post(url, headers=request_headers, content=body)
        assert first.status_code == 201
        assert second.headers["idempotent-replayed"] == "true"
        assert second.content == first.content
        count_url = curls[4].split("'")[1]
        assert httpx.get(count_url).json() == {"created": 1, "deliveries": 1}
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()
    assert code == 0
    assert refuses_connections(port) and refuses_connections(upstream_port)


@pytest.mark.slow
async def test_several_workers_share_one_fresh_schema(schema):
    node = NodeUpstream().start()
    try:
        async with fresh_database(schema) as url:
            gateway = GatewayProcess(
                node.url, url, "--tenant-from", "authorization", "--workers", "3"
            )
            gateway.start(timeout=60)
            try:
                async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
                    keys = [new_key() for _ in range(6)]
                    statuses = [
                        (
                            await http.post(
                                "/orders",
                                json={"sku": "W"},
                                headers={"authorization": "Bearer w", **headers(None, key)},
                            )
                        ).status_code
                        for key in keys
                    ]
            finally:
                gateway.stop()
        assert statuses == [201] * 6
        assert all(node.created(key) == 1 for key in keys)
    finally:
        node.stop()


def test_compose_runs_the_upstream_and_the_gateway_in_front():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    upstream, gateway = services["upstream"], services["gateway"]
    assert "examples/gateway/upstream.js" in upstream["command"]
    assert upstream["image"].startswith("node:")
    environment = gateway["environment"]
    assert environment["IDEMPOTENCY_GATEWAY_UPSTREAM"] == "http://upstream:9000"
    assert environment["DATABASE_URL"] == services["api"]["environment"]["DATABASE_URL"]
    assert environment["IDEMPOTENCY_GATEWAY_HOST"] == "0.0.0.0"
    assert "idempotency-asgi gateway" in gateway["command"]
    assert gateway["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "upstream" in gateway["depends_on"]
    # Every variable named is one the gateway reads.
    from idempotency_asgi.gateway.options import OPTIONS

    known = {option.env for option in OPTIONS}
    assert set(environment) <= known
