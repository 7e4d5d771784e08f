"""A full disk never reruns a request. Eleven stalled uploads without credentials fill the
gateway's temporary directory (an 8 MiB tmpfs here); another tenant's keyed POST then gets an
answer of 600 KB, under the 1 MiB storage limit but past the 256 KiB held in memory. Its
temporary file failed (ENOSPC), the exchange ended as "outcome unknown" (504), the retry got
409 and, after the lease, ran again. Now an answer the gateway has read whole is held in
memory within the storage limit when its file fails, recorded, and replayed. The same when
the process's own bound on temporary files (`--spool-disk-bytes`) is what is full. The
gateway is the real command on each parser, the upstream a bare socket."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway_support import GatewayProcess, Received, answer
from tests.helpers import key_row, new_key
from tests.test_gateway_storage import tenant_of

ANSWER = bytes(range(256)) * 2400  # 600 KB, in one write


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def upstream(scripted_upstream):
    def large(conn: socket.socket, request: Received) -> bool:
        conn.sendall(answer(201, [(b"Content-Type", b"application/octet-stream")], ANSWER))
        return True

    scripted_upstream.routes[b"/export"] = large
    return scripted_upstream


def stalled_uploads(gateway: GatewayProcess, count: int, sent: int) -> list[socket.socket]:
    """Unkeyed POSTs declaring 1 MiB, `sent` bytes of it sent, then nothing: each is read
    ahead into a temporary file, and waits for the rest."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 1048576\r\n\r\n")
        sock.sendall(b"u" * sent)
        sockets.append(sock)
    return sockets


async def keyed_twice(gateway: GatewayProcess, credential: str, key: str):
    sent = {"authorization": credential, "idempotency-key": key}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        first = await http.post("/export", content=b"{}", headers=sent)
        retry = await http.post("/export", content=b"{}", headers=sent)
    return first, retry


@pytest.mark.parametrize("parser", ["h11", "httptools"])
async def test_a_full_temporary_disk_never_makes_a_keyed_request_run_twice(
    upstream, schema, db, tmp_path, parser
):
    with small_disk(tmp_path / "spool", "8m") as spool:
        gateway = GatewayProcess(
            upstream.url, schema, "--tenant-from", "authorization", "--http", parser
        ).start(env={"TMPDIR": str(spool)})
        try:
            stalled = stalled_uploads(gateway, 11, 760_000)
            try:
                credential, key = f"Bearer {uuid.uuid4().hex}", new_key()
                before = upstream.count(b"/export")
                first, retry = await keyed_twice(gateway, credential, key)
            finally:
                for sock in stalled:
                    sock.close()
        finally:
            gateway.stop()
    assert (first.status_code, len(first.content)) == (201, len(ANSWER)), first.text[:200]
    assert first.content == ANSWER
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == ANSWER
    assert upstream.count(b"/export") == before + 1
    row = await key_row(db, tenant_of(credential), key)
    assert (row["state"], row["response_status"]) == ("completed", 201)


async def test_the_process_bound_on_temporary_files_holds_and_answers_still_arrive(
    upstream, schema, db
):
    """`--spool-disk-bytes 2 MiB`: the uploads that would take more get 503 before anything
    is forwarded, and a keyed answer past the memory buffer is held in memory and recorded."""
    gateway = GatewayProcess(
        upstream.url,
        schema,
        "--tenant-from",
        "authorization",
        "--spool-disk-bytes",
        str(2 * 1024 * 1024),
    ).start()
    try:
        stalled = stalled_uploads(gateway, 4, 760_000)
        try:
            refused = []
            for sock in stalled:
                sock.settimeout(0.5)
                with contextlib.suppress(TimeoutError):
                    refused.append(sock.recv(65536))
            credential, key = f"Bearer {uuid.uuid4().hex}", new_key()
            first, retry = await keyed_twice(gateway, credential, key)
        finally:
            for sock in stalled:
                sock.close()
    finally:
        gateway.stop()
    assert len(refused) == 2, refused  # two of 760 KB fit in 2 MiB, the others do not
    assert all(b" 503 " in answer_ and b"gateway-storage-failed" in answer_ for answer_ in refused)
    assert first.status_code == 201 and first.content == ANSWER
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == ANSWER
