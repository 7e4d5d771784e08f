"""Running the application once under a lease, and recording what it answered."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import problems
from .context import SCOPE_KEY
from .errors import OutcomeUnknown, StoreError, StoreUnavailable, TransactionFailed
from .lease import Heartbeat
from .records import Lease, StoredResponse, expiry_header
from .store import PostgresStore
from .telemetry import RequestTelemetry

logger = logging.getLogger("idempotency_asgi")

#: Retry-After on a 503: long enough for a failover or a pool to recover, short enough that
#: an automatic retry still looks like the same user action.
STORE_RETRY_AFTER = 2.0

#: The answer whenever the store fails a keyed request: nothing ran, or it rolled back.
STORE_UNAVAILABLE = problems.store_unavailable(STORE_RETRY_AFTER)
TRANSACTION_FAILED = problems.transaction_failed()
TRANSACTION_CONFLICT = problems.transaction_conflict(1.0)


class Phase(enum.Enum):
    """Where one run stands. Every run ends in PASSING or DROPPING, with its key recorded,
    released, or (OutcomeUnknown, a store that cannot be reached) left to its lease."""

    RUNNING = "running"  # the app runs; its response is captured and held back
    SETTLING = "settling"  # the response is complete: being recorded, or the key given up
    PASSING = "passing"  # settled: the rest of the app's messages go to the client
    DROPPING = "dropping"  # settled: the client has another answer, or is gone


class Execution:
    """One request's run: captures the response, then records it or gives the key up.

    The response is held back until it is recorded (in transactional mode: committed), so a
    client never sees a success whose record, or whose business writes, could still be lost.
    A body larger than `max_stored_bytes` is recorded as completed-but-not-replayable at the
    moment it overflows and is then streamed through (see `problems.not_replayable`).
    """

    def __init__(
        self,
        *,
        store: PostgresStore,
        lease: Lease,
        send: Send,
        report: RequestTelemetry,
        ttl_seconds: float,
        max_stored_bytes: int,
        excluded_headers: frozenset[bytes],
        release_statuses: Collection[int],
        on_recorded: Callable[[float], None] | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._send = send
        self._report = report
        self._ttl = ttl_seconds
        self._limit = max_stored_bytes
        self._excluded = excluded_headers
        self._release_statuses = release_statuses
        self._on_recorded = on_recorded
        self._txn = store.transaction()
        self._heartbeat = Heartbeat(store, lease)
        self._phase = Phase.RUNNING
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._client_gone = False
        self._started = asyncio.get_running_loop().time()

    @property
    def phase(self) -> Phase:
        return self._phase

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        self._heartbeat.start()
        try:
            await app({**scope, SCOPE_KEY: self._txn}, receive, self._capture)
        except OutcomeUnknown:
            if self._phase is not Phase.RUNNING:
                raise  # raised after the answer was settled: nothing left to decide
            self._phase = Phase.DROPPING
            # Neither recorded nor released: the key stays in flight until its lease lapses,
            # so no retry runs while the first attempt might still take effect.
            await asyncio.shield(self._abandon())
            self._report("outcome_unknown", 504)
            await self._deliver(problems.outcome_unknown(self._lease.seconds))
        except BaseException as exc:
            if self._phase is not Phase.RUNNING:
                raise  # after the answer was settled (a background task failed, say)
            self._phase = Phase.DROPPING
            # A StoreUnavailable here came from connection(request): the database failed.
            database_failed = isinstance(exc, StoreUnavailable) or self._txn.broken()
            # Shielded: a cancelled request must still roll back and give its key up.
            await asyncio.shield(self._give_up())
            if database_failed and isinstance(exc, Exception):
                logger.warning("database failed while the application ran: %r", exc)
                self._report("store_error", STORE_UNAVAILABLE.status)
                await self._deliver(STORE_UNAVAILABLE)
                return
            self._report("released", 500)
            raise
        if self._phase is Phase.RUNNING:
            # The application returned without a whole response: the server answers 500.
            self._phase = Phase.DROPPING
            await self._give_up()
            self._report("released", 500)

    # -- capture ---------------------------------------------------------------------------

    async def _capture(self, message: Message) -> None:
        if self._phase is Phase.PASSING:
            await self._forward(message)
            return
        if self._phase is not Phase.RUNNING:
            return  # the client has another answer, or is gone
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            self._chunks.append(chunk)
            self._size += len(chunk)
            more_body = bool(message.get("more_body", False))
            if not more_body or self._size > self._limit:
                await self._settle(more_body=more_body)

    async def _settle(self, *, more_body: bool) -> None:
        """The response is complete, or too large to hold: record it or give the key up, then
        send the answer. This happens as soon as the body is complete, before the application
        returns (so background tasks run after the client has its answer, outside the
        transaction). The decision runs shielded: once the response is known, a cancellation
        cannot stop it half way, and it cleans up after itself whatever fails."""
        self._phase = Phase.SETTLING
        deciding = asyncio.ensure_future(self._decide(overflow=self._size > self._limit))
        try:
            answer = await asyncio.shield(deciding)
        except BaseException:
            self._phase = Phase.DROPPING
            if not deciding.done():
                deciding.add_done_callback(_log_failure)  # it finishes on its own
            raise
        if answer is None:
            self._phase = Phase.PASSING
            await self._flush(more_body=more_body)
        else:
            self._phase = Phase.DROPPING
            await self._deliver(answer)

    async def _decide(self, *, overflow: bool) -> problems.Problem | None:
        """Record the response, or give the key up; return the problem to answer with
        instead of the application's response, or None to send that response."""
        try:
            await self._heartbeat.stop()
            if self._txn.broken():
                await self._give_up()
                self._report("store_error", STORE_UNAVAILABLE.status)
                return STORE_UNAVAILABLE
            if not self._storable():
                await self._give_up()
                self._report("released", self._status)
                return None
            return await self._record(body=None if overflow else b"".join(self._chunks))
        except BaseException:
            # Whatever failed, nothing is left open: roll back, free the key (a no-op once
            # the record is committed, since release only touches an in-flight row).
            await self._give_up()
            raise

    @property
    def _status(self) -> int:
        assert self._start is not None
        return int(self._start["status"])

    def _storable(self) -> bool:
        status = self._status
        return status < 500 and status not in self._release_statuses

    # -- outcomes --------------------------------------------------------------------------

    async def _record(self, *, body: bytes | None) -> problems.Problem | None:
        assert self._start is not None
        headers = [
            (bytes(name), bytes(value))
            for name, value in self._start.get("headers", [])
            if bytes(name).lower() not in self._excluded
        ]
        response = StoredResponse(status=self._status, headers=headers, body=body)
        transactional = self._txn.used
        try:
            expires_at = await self._txn.complete(self._lease, response, ttl_seconds=self._ttl)
        except TransactionFailed as exc:
            return await self._record_without_transaction(response, exc)
        except StoreError as exc:
            if not transactional:
                # Plain mode: the effect has happened whatever we do now. Sending the answer
                # gives the client no reason to retry; the key stays in flight until its
                # lease lapses, after which a retry would run again. (Transactional mode has
                # no such window; this is why it exists.)
                logger.error("could not record the response; key left to its lease: %s", exc)
                self._report("store_error", self._status)
                return None
            logger.warning("transaction failed at completion, rolled back: %s", exc)
            await self._release()
            self._report("store_error", STORE_UNAVAILABLE.status)
            return STORE_UNAVAILABLE
        if expires_at is None:
            if not transactional:
                logger.error("lease lost before completion; the response was not recorded")
                self._report("lease_lost", self._status)
                return None
            self._report("lease_lost", 409)
            return problems.lease_lost()
        self._recorded(expires_at)
        return None

    async def _record_without_transaction(
        self, response: StoredResponse, failure: TransactionFailed
    ) -> problems.Problem | None:
        """The request's transaction could not commit, and has rolled back. A 4xx is still
        the application's answer (it caught a database error and said no): it is recorded on
        its own. A success is not true any more: the writes it speaks of are gone. Unless
        the transaction was READ ONLY: then there were no writes to lose, whatever it said."""
        if failure.transient:
            # A serialization failure or a deadlock: running it again may well succeed.
            await self._release()
            self._report("released", TRANSACTION_CONFLICT.status)
            return TRANSACTION_CONFLICT
        if not (failure.read_only or 400 <= response.status < 500):
            logger.error("the application answered %d, but %s", response.status, failure)
            await self._release()
            self._report("released", TRANSACTION_FAILED.status)
            return TRANSACTION_FAILED
        try:
            expires_at = await self._store.complete(self._lease, response, ttl_seconds=self._ttl)
        except StoreError as exc:
            logger.warning("could not record the answer, key released: %s", exc)
            await self._release()
            self._report("store_error", STORE_UNAVAILABLE.status)
            return STORE_UNAVAILABLE
        if expires_at is None:
            self._report("lease_lost", response.status)  # nothing was written: it is true
            return None
        self._recorded(expires_at)
        return None

    def _recorded(self, expires_at: datetime) -> None:
        assert self._start is not None
        self._report("new", self._status)
        if self._on_recorded is not None:
            self._on_recorded(asyncio.get_running_loop().time() - self._started)
        self._start = {
            **self._start,
            "headers": [*self._start.get("headers", []), expiry_header(expires_at)],
        }

    async def _abandon(self) -> None:
        """Stop renewing the lease and roll back, but keep the key reserved."""
        await self._heartbeat.stop()
        await self._txn.close()

    async def _give_up(self) -> None:
        """Roll back the business writes, then free the key for the next retry."""
        await self._abandon()
        await self._release()

    async def _release(self) -> None:
        try:
            await self._store.release(self._lease)
        except StoreError as exc:
            logger.warning(
                "could not release the key; it will be free when its lease lapses: %s", exc
            )

    # -- sending ---------------------------------------------------------------------------

    async def _flush(self, *, more_body: bool = False) -> None:
        assert self._start is not None
        await self._forward(self._start)
        await self._forward(
            {"type": "http.response.body", "body": b"".join(self._chunks), "more_body": more_body}
        )
        self._chunks = []

    async def _deliver(self, problem: problems.Problem) -> None:
        headers, body = problem.render()
        await self._forward(
            {"type": "http.response.start", "status": problem.status, "headers": headers}
        )
        await self._forward({"type": "http.response.body", "body": body})

    async def _forward(self, message: Message) -> None:
        if self._client_gone:
            return
        try:
            await self._send(message)
        except OSError:
            # The client went away. The outcome is already settled; its retry gets it.
            self._client_gone = True
            self._phase = Phase.DROPPING


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("settling a cancelled request failed: %r", task.exception())
