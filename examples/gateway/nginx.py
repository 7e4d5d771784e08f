"""nginx with `nginx.conf` (beside this file) in a directory of its own, on the ports given:
what the tests and the benchmark run. It needs Debian's `nginx-light` (or any nginx 1.15.3
or later on PATH); `available()` says whether there is one.

    with Nginx(listen=8000, gateway=8080, service=9000) as nginx:
        ... nginx.url ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

EXAMPLE = Path(__file__).resolve().parent / "nginx.conf"

_MAIN = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {prefix}/idempotency.conf;
}}
"""


def executable() -> str | None:
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx",) if os.access(path, os.X_OK)), None
    )


def available() -> bool:
    return executable() is not None


def render(
    listen: int, gateway: int, service: int, *, replace: dict[str, str] | None = None
) -> str:
    """The example with its three addresses moved to these ports (and any other text
    replaced, `{old: new}`: a test shortens a timeout this way)."""
    text = EXAMPLE.read_text()
    for old, new in {
        "listen 127.0.0.1:8000;": f"listen 127.0.0.1:{listen};",
        "server 127.0.0.1:8080;": f"server 127.0.0.1:{gateway};",
        "server 127.0.0.1:9000;": f"server 127.0.0.1:{service};",
        **(replace or {}),
    }.items():
        if old not in text:
            raise ValueError(f"{old!r} is not in {EXAMPLE}")
        text = text.replace(old, new)
    return text


class Nginx:
    def __init__(
        self, *, listen: int, gateway: int, service: int, replace: dict[str, str] | None = None
    ) -> None:
        self.port = listen
        self._config = render(listen, gateway, service, replace=replace)
        self._prefix: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Nginx:
        binary = executable()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        prefix = Path(tempfile.mkdtemp(prefix="idempotency-nginx-"))
        # Run as root, nginx's workers drop to an unprivileged user, which must reach these.
        prefix.chmod(0o755)
        for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (prefix / name).mkdir()
            (prefix / name).chmod(0o777)
        (prefix / "idempotency.conf").write_text(self._config)
        (prefix / "nginx.conf").write_text(_MAIN.format(prefix=prefix))
        self._prefix = prefix
        self.process = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (prefix / "error.log").read_text() if (prefix / "error.log").exists() else ""
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {log}")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not listen on {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # fast shutdown: workers go at once
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._prefix is not None:
            shutil.rmtree(self._prefix, ignore_errors=True)
            self._prefix = None

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
