"""The pytest plugin scripts/mutate loads (`-p tests.mutation`); plain test runs never do.

mutmut runs, for each mutant, the tests that called the mutated function while it gathered its
statistics. For the functions every request goes through (the claim, the execution, the
fingerprint) that is every test, and a mutant that survives pays for all of them. Here each
core module gets the test files that can tell its mutants apart, and the slow ones (those that
wait for leases, heartbeats and waiting duplicates) only where they test that module's code.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

HTTP = "tests/test_http_contract.py"
STORE = "tests/test_store.py"
TRANSACTION = "tests/test_request_transaction.py"
SETTINGS = "tests/test_handler_settings.py"
WAITING = "tests/test_waiting.py"
FAILURES = "tests/test_store_failures.py"
PARSERS = "tests/test_fingerprint_parsers.py"

#: Test files per core module: a mutant of the module runs the tests of these files that
#: called its function (what mutmut found), and no others.
SUBSETS: dict[str, tuple[str, ...]] = {
    "_asgi.keys": (HTTP, "tests/test_keys.py"),
    "_asgi.fingerprint": (
        HTTP,
        PARSERS,
        "tests/test_fingerprint_headers.py",
        "tests/test_fingerprint_request_line.py",
        "tests/test_fingerprint_bodies.py",
    ),
    "_asgi.canonical": (
        HTTP,
        PARSERS,
        "tests/test_fingerprint_headers.py",
        "tests/test_fingerprint_bodies.py",
    ),
    "_asgi.lease": (HTTP, STORE, SETTINGS, WAITING, "tests/test_fencing.py"),
    "_postgres.transaction": (
        HTTP,
        TRANSACTION,
        SETTINGS,
        FAILURES,
        STORE,
        "tests/test_outcome_unknown.py",
        "tests/test_transaction_end.py",
        "tests/test_fencing.py",
    ),
    "_asgi.execution": (
        HTTP,
        TRANSACTION,
        STORE,
        FAILURES,
        SETTINGS,
        "tests/test_telemetry.py",
        "tests/test_outcome_unknown.py",
        "tests/test_fencing.py",
        "tests/test_retry_after.py",
        "tests/test_transaction_end.py",
        "tests/test_hidden_extensions.py",
        "tests/test_settlements.py",
    ),
    "_postgres.store": (
        HTTP,
        STORE,
        TRANSACTION,
        FAILURES,
        WAITING,
        SETTINGS,
        "tests/test_maintenance.py",
        "tests/test_consumer.py",
        "tests/test_fencing.py",
        "tests/test_outcome_unknown.py",
        "tests/test_shared_pool.py",
        "tests/test_store_maintenance_calls.py",
        "tests/test_batching.py",
    ),
    "_postgres.batching": (
        "tests/test_batcher.py",
        "tests/test_batching.py",
        "tests/test_contention.py",
        STORE,
        HTTP,
        TRANSACTION,
    ),
    "_postgres.outages": (
        "tests/test_outages.py",
        FAILURES,
        "tests/test_contention.py",
        STORE,
    ),
    "_postgres.claiming": (
        HTTP,
        STORE,
        "tests/test_batching.py",
        "tests/test_contention.py",
        "tests/test_atomic.py",
        "tests/test_replay_cache.py",
        WAITING,
        FAILURES,
        "tests/test_settlements.py",
    ),
    "_postgres.recording": (
        HTTP,
        STORE,
        TRANSACTION,
        "tests/test_batching.py",
        "tests/test_contention.py",
        "tests/test_fencing.py",
        FAILURES,
    ),
    "_postgres.atomic": (
        "tests/test_atomic.py",
        "tests/test_replay_cache.py",
        "tests/test_settlements.py",
        HTTP,
    ),
    "_asgi.middleware": (
        HTTP,
        TRANSACTION,
        FAILURES,
        WAITING,
        "tests/test_root_path.py",
        "tests/test_telemetry.py",
        "tests/test_durations.py",
        "tests/test_retry_after.py",
        "tests/test_fingerprint_headers.py",
        "tests/test_hidden_extensions.py",
        "tests/test_keys.py",
        "tests/test_outcome_unknown.py",
        "tests/test_fingerprint_request_line.py",
        "tests/test_path_options.py",
        "tests/test_settlements.py",
    ),
}


#: A test still running after this long under a mutant has hung (a connection never given
#: back keeps shutdown waiting, a wait never ends); no test takes a tenth of it unmutated.
#: The run stops at once with the exit status mutmut reads as a timeout, rather than holding
#: a worker until mutmut's own limit for the whole selection runs out.
HUNG_SECONDS = 30
TIMEOUT_STATUS = 36


def module_under_test() -> str | None:
    """The core module whose mutant this run tests (`_asgi.fingerprint`), or None outside
    one."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if not mutant.startswith("idempotency_asgi."):
        return None  # the statistics run, the clean run, the forced failure: every test
    return ".".join(mutant.split(".")[1:-1])  # between the package and the mutated function


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    module = module_under_test()
    if module is None or module not in SUBSETS:
        return
    files = SUBSETS[module]
    kept = [item for item in items if item.nodeid.split("::")[0] in files]
    dropped = [item for item in items if item.nodeid.split("::")[0] not in files]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    if module_under_test() is None:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(HUNG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _hung(signum: int, frame: object) -> None:
    os._exit(TIMEOUT_STATUS)
