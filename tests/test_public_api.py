import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import idempotency_asgi

PACKAGE = Path(idempotency_asgi.__file__).parent


def test_public_names_are_pinned():
    # What users import: adding a name is a decision, removing one a breaking change (and a
    # line in CHANGELOG.md).
    assert idempotency_asgi.__all__ == [
        "DEFAULT_EXCLUDED_HEADERS",
        "DEFAULT_RELEASE_STATUSES",
        "BackgroundMaintenance",
        "HeldKey",
        "HeldReason",
        "IdempotencyConfig",
        "IdempotencyMiddleware",
        "IdempotentConsumer",
        "KeyCompleted",
        "KeyNotFound",
        "KeyRunning",
        "OutcomeUnknown",
        "PostgresStore",
        "Processed",
        "Reaper",
        "Reconciled",
        "ReconciliationRefused",
        "StoreError",
        "StoreRefused",
        "StoreUnavailable",
        "Sweeper",
        "TenantResolver",
        "TransactionEnded",
        "after_commit",
        "connection",
        "migrate",
    ]
    for name in idempotency_asgi.__all__:
        assert getattr(idempotency_asgi, name) is not None
    public = {"__init__", "__main__", "fastapi", "maintenance", "problems", "gateway", "verify"}
    public |= {"sqlalchemy", "alembic", "client"}  # each needs an extra of its own
    modules = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or path.is_dir()}
    exposed = {m for m in modules if not m.startswith("_") and m != "py"} - {"__pycache__"}
    assert exposed <= public, exposed - public  # every other module is private


def test_the_package_imports_in_one_direction():
    # No import circle between the package's modules, not even one only a type checker
    # follows (under TYPE_CHECKING): each depends on the ones below it.
    assert import_cycles() == []


def test_every_option_is_declared_once_and_reaches_both_the_middleware_and_the_gateway():
    from idempotency_asgi.gateway import build_gateway
    from idempotency_asgi.gateway.options import OPTIONS

    declared = {option.name for option in fields(idempotency_asgi.IdempotencyConfig)}
    # The command has a flag and a variable for each, derived from the field itself, but for
    # those only an application can set: the gateway cannot share its upstream's transaction.
    applications_only = {"atomic", "isolation_level", "transaction_idle_seconds"}
    assert {option.field for option in OPTIONS if option.config} == declared - applications_only
    # ...and neither the middleware nor the gateway declares one again as a parameter.
    for build in (idempotency_asgi.IdempotencyMiddleware, build_gateway):
        assert declared.isdisjoint(inspect.signature(build).parameters)


def import_cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    files = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                inside = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
                graph[name].update(inside)
                if target in files and len(inside) < len(node.names):
                    graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in files)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_fastapi_dependency_is_the_same_connection_helper():
    from idempotency_asgi.fastapi import Connection, connection

    assert connection is idempotency_asgi.connection
    assert Connection.__metadata__[0].dependency is connection


@pytest.mark.parametrize(
    "options",
    [
        {"lease_seconds": 0},
        {"ttl_seconds": -1},
        {"lease_seconds": float("inf")},
        {"ttl_seconds": float("nan")},
        {"ttl_seconds": 1e12},  # past what PostgreSQL's timestamps reach
    ],
)
def test_leases_and_retention_must_be_positive_finite_and_storable(options):
    from starlette.applications import Starlette

    store = idempotency_asgi.PostgresStore("postgresql://unused")
    [(name, value)] = options.items()
    with pytest.raises(ValueError, match=f"^{name}={value!r}: must be"):
        idempotency_asgi.IdempotencyMiddleware(
            Starlette(), store=store, tenant=lambda scope: "t", **options
        )
