"""An HTTP/1.1 proxy in front of a server that cuts connections on purpose, in threads of its
own (so sync and async clients alike can use it): each client connection carries one
request, and the proxy does with it what the next entry of its plan says.

    pass          forward the request, relay the whole answer, close
    lose-request  read the request, close: the server never sees it
    lose-answer   forward the request, wait for the whole answer, close without sending it:
                  the server ran the request and answered; the client heard nothing
    cut-early     forward the request, close at once: the client hears nothing while the
                  server runs it (the proxy reads the answer later, and drops it)
    cut-body      forward the request, wait for the whole answer, send its head and half its
                  body, close: the server ran the request; the client heard part of the answer

When the plan runs out, every connection passes. `seen` lists what each connection got.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque
from collections.abc import Iterable


class CuttingProxy:
    def __init__(self, upstream_port: int, plan: Iterable[str] = ()) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._plan: deque[str] = deque(plan)
        self._lock = threading.Lock()
        self.seen: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._closing = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def plan(self, *steps: str) -> None:
        with self._lock:
            self._plan.extend(steps)

    def __enter__(self) -> CuttingProxy:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        for thread in self._threads:
            thread.join(timeout=10)
        self._listener.close()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)  # to see `_closing`: closing does not wake accept()
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                step = self._plan.popleft() if self._plan else "pass"
                self.seen.append(step)
            thread = threading.Thread(target=self._serve, args=(client, step), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, client: socket.socket, step: str) -> None:
        with contextlib.closing(client):
            client.settimeout(30)
            request = _read_message(client)
            if request is None or step == "lose-request":
                return
            upstream = socket.create_connection(self._upstream, timeout=30)
            with contextlib.closing(upstream):
                upstream.sendall(request)
                if step == "cut-early":
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                answer = _read_message(upstream)
                if step in ("pass", "cut-body") and answer is not None:
                    # One request per connection: the client must not send another on it.
                    head, _, body = answer.partition(b"\r\n\r\n")
                    if step == "cut-body":
                        body = body[: len(body) // 2]
                    client.sendall(head + b"\r\nconnection: close\r\n\r\n" + body)


def _read_message(sock: socket.socket) -> bytes | None:
    """One whole HTTP/1.1 message (head and a Content-Length body), or None when the peer
    closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return head + b"\r\n\r\n" + body
