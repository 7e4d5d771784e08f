"""The operator's commands, run as the real `idempotency-asgi` command against a database of
their own: `held` (as text and as JSON lines), `settle`, `release`, their refusals and exit
statuses, and what `stats` and `inspect` say of held keys."""

from __future__ import annotations

import json

import asyncpg
import pytest

from idempotency_asgi import HeldReason, PostgresStore, migrate
from idempotency_asgi._records import Outcome
from tests.helpers import fresh_database
from tests.test_maintenance import add, claim, cli


@pytest.fixture
async def empty(schema):
    async with fresh_database(schema) as url:
        await migrate(url)
        store = PostgresStore(url)
        conn = await asyncpg.connect(url)
        try:
            yield url, store, conn
        finally:
            await conn.close()
            await store.close()


async def held(store, key, tenant="acme", reason=HeldReason.OUTCOME_UNKNOWN):
    lease = await add(store, key, completed=False, tenant=tenant)
    assert await store.hold(lease, reason)
    return lease


async def test_held_lists_each_key_as_text_and_as_json_lines(empty):
    url, store, conn = empty
    assert cli("held", url=url).stdout.strip() == "no keys held"
    await held(store, "k-unknown")
    await held(store, "k-ended", tenant="globex", reason=HeldReason.TRANSACTION_ENDED)
    await add(store, "k-running", completed=False, tenant="acme")  # a live lease: not held
    await add(store, "k-done", tenant="acme")
    await add(store, "k-dead", completed=False, tenant="acme")
    await conn.execute(
        "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 minute'"
        " WHERE idempotency_key = 'k-dead'"
    )

    shown = cli("held", url=url)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["tenant", "key", "method", "path", "since", "reason", "until"]
    assert sorted(line.split()[1] for line in lines[1:]) == ["k-dead", "k-ended", "k-unknown"]
    assert any(line.split()[:2] == ["globex", "k-ended"] for line in lines)

    as_json = cli("held", "--json", "--tenant", "acme", url=url)
    assert as_json.returncode == 0, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert {(r["key"], r["reason"]) for r in rows} == {
        ("k-unknown", "outcome-unknown"),
        ("k-dead", "lease-lapsed"),
    }
    assert set(rows[0]) == {"tenant", "key", "method", "path", "since", "reason", "until"}
    assert rows[0]["tenant"] == "acme" and rows[0]["method"] == "POST"
    assert cli("held", "--json", "--older-than", "3600", url=url).stdout == ""


async def test_settle_writes_the_answer_a_retry_replays(empty, tmp_path):
    url, store, conn = empty
    await held(store, "k")
    body = tmp_path / "answer.json"
    body.write_bytes(b'{"charge": "ch_1"}\n')
    settled = cli(
        "settle",
        "--tenant",
        "acme",
        "k",
        "--status",
        "201",
        "--body-file",
        str(body),
        "--header",
        "Content-Type: application/json",
        "--header",
        "X-Provider:  stripe ",
        url=url,
    )
    assert settled.returncode == 0, settled.stderr
    assert settled.stdout.startswith("settled key 'k' of tenant 'acme' (was outcome-unknown): 201")
    replay = await claim(store, "k", tenant="acme")
    assert replay.outcome is Outcome.COMPLETED
    assert replay.response.body == b'{"charge": "ch_1"}\n'
    assert list(replay.response.headers) == [
        (b"content-type", b"application/json"),
        (b"x-provider", b"stripe"),
        (b"content-length", b"19"),
    ]
    row = await conn.fetchrow("SELECT * FROM idempotency_keys WHERE idempotency_key = 'k'")
    assert (row["state"], row["held_reason"], row["format_version"]) == ("completed", None, 1)

    # Again: it has an answer now.
    again = cli("settle", "--tenant", "acme", "k", "--status", "200", url=url)
    assert again.returncode == 1
    assert again.stderr.startswith("idempotency-asgi settle: refused: key 'k' of tenant 'acme':")
    assert "it has an answer already (201" in again.stderr and "--replace" in again.stderr
    replaced = cli(
        "settle", "--tenant", "acme", "k", "--status", "200", "--body", "é", "--replace", url=url
    )
    assert replaced.returncode == 0, replaced.stderr
    assert "(was completed)" in replaced.stdout
    assert (await claim(store, "k", tenant="acme")).response.body == "é".encode()


async def test_release_frees_the_key_and_refusals_say_why(empty):
    url, store, _ = empty
    await held(store, "k")
    released = cli("release", "--tenant", "acme", "k", url=url)
    assert released.returncode == 0, released.stderr
    assert released.stdout.strip() == (
        "released key 'k' of tenant 'acme' (was outcome-unknown): the next retry runs the request"
    )
    assert (await claim(store, "k", tenant="acme")).outcome is Outcome.CLAIMED

    missing = cli("release", "--tenant", "acme", "nope", url=url)
    assert (missing.returncode, missing.stderr.strip()) == (
        1,
        "idempotency-asgi release: refused: key 'nope' of tenant 'acme': no such key",
    )
    await add(store, "running", completed=False)
    for command in (["release"], ["settle", "--status", "201"]):
        busy = cli(*command, "--tenant", "t", "running", url=url)
        assert busy.returncode == 1
        assert "refused: key 'running' of tenant 't': its request is running" in busy.stderr
    await add(store, "done", tenant="acme")
    done = cli("release", "--tenant", "acme", "done", url=url)
    assert done.returncode == 1 and "--completed" in done.stderr
    forced = cli("release", "--tenant", "acme", "done", "--completed", url=url)
    assert forced.returncode == 0 and "(was completed)" in forced.stdout


async def test_settle_refuses_an_answer_it_could_not_replay_as_usage(empty):
    url, store, _ = empty
    await held(store, "k")
    for extra, message in (
        (["--status", "503"], "status must be from 200 to 499"),
        (["--status", "201", "--header", "no colon"], 'write it as "Name: value"'),
        (["--status", "201", "--body-file", "/no/such/file"], "No such file"),
    ):
        refused = cli("settle", "--tenant", "acme", "k", *extra, url=url)
        assert (refused.returncode, message in refused.stderr) == (2, True), refused.stderr
    both = cli("settle", "--tenant", "acme", "k", "--status", "201", "--body", "a",
               "--body-file", "b", url=url)  # fmt: skip
    assert both.returncode == 2
    assert (await claim(store, "k", tenant="acme")).outcome is Outcome.IN_FLIGHT  # unchanged


async def test_stats_and_inspect_show_held_keys(empty):
    url, store, _ = empty
    await add(store, "done")
    await held(store, "h1")
    await held(store, "h2", reason=HeldReason.NOT_RECORDED)
    stats = cli("stats", url=url)
    assert stats.returncode == 0, stats.stderr
    fields = dict(line.split(None, 1) for line in stats.stdout.splitlines())
    assert fields["held"] == "2" and fields["in_flight"] == "2"
    assert fields["oldest_held"] != "-"
    shown = cli("inspect", "--tenant", "acme", "h2", url=url)
    assert "held_reason       not-recorded" in shown.stdout


def test_the_commands_say_clearly_when_the_database_is_unreachable():
    for command in (["held"], ["release", "--tenant", "t", "k"]):
        result = cli(*command, url="postgresql://postgres@127.0.0.1:1/postgres")
        assert result.returncode == 1
        assert "database unavailable" in result.stderr and "Traceback" not in result.stderr
