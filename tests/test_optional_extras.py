"""The optional extras stay optional: with SQLAlchemy, Alembic or httpx absent, the package and
its other modules import, and the module that needs one says which extra installs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.server import ROOT

#: Run first in the child: the named top-level packages cannot be imported, as if absent.
HIDE = """
import sys

class Hidden:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError("No module named " + repr(name), name=name)
        return None

sys.meta_path.insert(0, Hidden(HIDDEN))
"""


def run_without(hidden: set[str], code: str) -> subprocess.CompletedProcess[str]:
    source = f"HIDDEN = {sorted(hidden)!r}\n" + HIDE + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_without_sqlalchemy_the_package_imports_and_the_session_module_names_its_extra():
    done = run_without(
        {"sqlalchemy", "sqlmodel", "alembic", "greenlet"},
        """
        import idempotency_asgi
        import idempotency_asgi.fastapi
        import idempotency_asgi.maintenance
        from idempotency_asgi import IdempotencyMiddleware, PostgresStore, connection
        from idempotency_asgi.fastapi import Connection, idempotent_route
        assert "sqlalchemy" not in sys.modules
        for name in ("idempotency_asgi.sqlalchemy", "idempotency_asgi.alembic"):
            try:
                __import__(name)
            except ImportError as exc:
                print(name, exc)
            else:
                raise SystemExit(f"{name} imported without SQLAlchemy")
        try:
            from idempotency_asgi.fastapi import Session
        except ImportError as exc:
            print("Session", exc)
        names = {}
        exec("from idempotency_asgi.fastapi import *", names)  # every name __all__ lists
        assert {"Connection", "connection", "idempotent_route"} <= set(names), sorted(names)
        assert "sqlalchemy" not in sys.modules
        """,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "pip install 'idempotency-asgi[sqlalchemy]'" in lines[0]
    assert "pip install 'idempotency-asgi[alembic]'" in lines[1]
    assert lines[2].startswith("Session") and "idempotency-asgi[sqlalchemy]" in lines[2]


def test_without_httpx_the_client_module_names_its_extra():
    done = run_without(
        {"httpx", "httpcore"},
        """
        import idempotency_asgi
        try:
            import idempotency_asgi.client
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("idempotency_asgi.client imported without httpx")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'idempotency-asgi[client]'" in done.stdout
