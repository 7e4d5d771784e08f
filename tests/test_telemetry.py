"""Each outcome leaves a log line, a metric sample and span attributes; never a raw key."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from idempotency_asgi._asgi.telemetry import key_hash
from tests.apps import build_app
from tests.helpers import client, headers, new_key


def sample(outcome: str) -> float:
    return REGISTRY.get_sample_value("idempotency_requests_total", {"outcome": outcome}) or 0.0


def lines(caplog) -> list[dict]:
    return [r.idempotency for r in caplog.records if hasattr(r, "idempotency")]


async def test_outcomes_are_logged_with_a_hashed_key_and_counted(schema, tenant, caplog):
    app = build_app(schema)
    key = new_key()
    secret_body = {"card": "4242424242424242"}
    before = {o: sample(o) for o in ("new", "replay", "mismatch", "released", "rejected")}
    with caplog.at_level(logging.INFO, logger="idempotency_asgi"):
        async with client(app) as http:
            await http.post("/tx/charge", json=secret_body, headers=headers(tenant, key))
            await http.post("/tx/charge", json=secret_body, headers=headers(tenant, key))
            await http.post("/tx/charge", json={"other": 1}, headers=headers(tenant, key))
            await http.post(
                "/tx/charge", json={}, headers=headers(tenant, key + "x", x_status="500")
            )
            await http.post("/tx/charge", json={}, headers=headers(tenant))
    logged = lines(caplog)
    assert [line["outcome"] for line in logged] == [
        "new",
        "replay",
        "mismatch",
        "released",
        "rejected",
    ]
    assert [line["status"] for line in logged] == [201, 201, 422, 500, 400]
    assert logged[0]["tenant"] == tenant and logged[0]["key_hash"] == key_hash(key)
    assert logged[0]["method"] == "POST" and logged[0]["path"] == "/tx/charge"
    assert all(line["duration_ms"] >= 0 for line in logged)
    text = caplog.text
    assert key not in text and "4242" not in text
    assert "outcome=replay" in text and f"key_hash={key_hash(key)}" in text
    for outcome, count in before.items():
        assert sample(outcome) == count + 1, outcome
    histogram = REGISTRY.get_sample_value(
        "idempotency_request_duration_seconds_count", {"outcome": "new"}
    )
    assert histogram and histogram >= 1


async def test_store_errors_are_warnings(schema, tenant, caplog):
    from idempotency_asgi import PostgresStore

    app = build_app(schema, store=PostgresStore("postgresql://postgres@127.0.0.1:1/x", timeout=0.5))
    with caplog.at_level(logging.INFO, logger="idempotency_asgi"):
        async with client(app) as http:
            await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
    [line] = [r for r in caplog.records if hasattr(r, "idempotency")]
    assert line.idempotency["outcome"] == "store_error" and line.levelno == logging.WARNING


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


async def test_span_attributes_when_opentelemetry_is_present(schema, tenant, spans):
    tracer, exporter = spans
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        for name in ("first", "retry"):
            with tracer.start_as_current_span(name):
                await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finished = {span.name: dict(span.attributes) for span in exporter.get_finished_spans()}
    assert finished["first"]["idempotency.outcome"] == "new"
    assert finished["first"]["idempotency.replayed"] is False
    assert finished["retry"]["idempotency.outcome"] == "replay"
    assert finished["retry"]["idempotency.replayed"] is True
    assert finished["retry"]["idempotency.key_hash"] == key_hash(key)
    assert finished["retry"]["idempotency.tenant"] == tenant
