"""Running the application once under a lease, and recording what it answered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import problems
from .context import SCOPE_KEY
from .errors import OutcomeUnknown, StoreError
from .lease import Heartbeat
from .records import Lease, StoredResponse, expiry_header
from .store import PostgresStore
from .telemetry import RequestTelemetry
from .transaction import Transaction

logger = logging.getLogger("idempotency_asgi")

#: Retry-After on a 503: long enough for a failover or a pool to recover, short enough that
#: an automatic retry still looks like the same user action.
STORE_RETRY_AFTER = 2.0

#: The answer whenever the store fails a keyed request: nothing ran, or it rolled back.
STORE_UNAVAILABLE = problems.store_unavailable(STORE_RETRY_AFTER)


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
    ) -> None:
        self._store = store
        self._lease = lease
        self._send = send
        self._report = report
        self._ttl = ttl_seconds
        self._limit = max_stored_bytes
        self._excluded = excluded_headers
        self._release_statuses = release_statuses
        self._txn: Transaction = store.transaction()
        self._heartbeat = Heartbeat(store, lease)
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._settled = False  # recorded or given up: later messages go straight through
        self._drop = False  # the client already has its answer (a problem): swallow the rest

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        self._heartbeat.start()
        scope = {**scope, SCOPE_KEY: self._txn}
        try:
            await app(scope, receive, self._capture)
        except OutcomeUnknown:
            if self._settled:
                raise
            # Neither recorded nor released: the key stays in flight until its lease lapses,
            # so no retry runs while the first attempt might still take effect.
            self._settled = self._drop = True
            await asyncio.shield(self._abandon())
            await self._report.answer(
                self._send, "outcome_unknown", problems.outcome_unknown(self._lease.seconds)
            )
            return
        except BaseException as exc:
            if self._settled:
                raise  # after the answer was settled (a background task failed, say)
            database_failed = isinstance(exc, Exception) and self._txn.failed(exc)
            # Shielded: a cancelled request must still roll back and give its key up.
            await asyncio.shield(self._give_up())
            if database_failed:
                logger.warning("database failed while the application ran: %r", exc)
                await self._report.answer(self._send, "store_error", STORE_UNAVAILABLE)
                return
            self._report("released", 500)
            raise
        if not self._settled:
            # The application returned without a whole response: the server answers 500.
            await self._give_up()
            self._report("released", 500)

    # -- capture ---------------------------------------------------------------------------

    async def _capture(self, message: Message) -> None:
        if self._settled:
            if not self._drop:
                await self._forward(message)
            return
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
        send it. This happens as soon as the body is complete, before the application returns
        (so background tasks run after the client has its answer, outside the transaction)."""
        self._settled = True
        await self._heartbeat.stop()
        if self._txn.failed():
            await self._give_up()
            self._drop = True
            await self._report.answer(self._send, "store_error", STORE_UNAVAILABLE)
        elif not self._storable():
            await self._give_up()
            self._report("released", self._status)
            await self._flush(more_body=more_body)
        elif await self._record(body=None if self._size > self._limit else b"".join(self._chunks)):
            await self._flush(more_body=more_body)
        else:
            self._drop = True

    @property
    def _status(self) -> int:
        assert self._start is not None
        return int(self._start["status"])

    def _storable(self) -> bool:
        status = self._status
        return status < 500 and status not in self._release_statuses

    # -- outcomes --------------------------------------------------------------------------

    async def _record(self, *, body: bytes | None) -> bool:
        """Store the response and report the outcome; True when the captured response should
        now be sent."""
        assert self._start is not None
        headers = [
            (bytes(name), bytes(value))
            for name, value in self._start.get("headers", [])
            if bytes(name).lower() not in self._excluded
        ]
        response = StoredResponse(status=self._status, headers=headers, body=body)
        transactional = self._txn.opened
        try:
            expires_at = await self._txn.complete(self._lease, response, ttl_seconds=self._ttl)
        except StoreError as exc:
            if not transactional:
                # Plain mode: the effect has happened whatever we do now. Sending the answer
                # gives the client no reason to retry; the key stays in flight until its
                # lease lapses, after which a retry would run again. (Transactional mode has
                # no such window; this is why it exists.)
                logger.error("could not record the response; key left to its lease: %s", exc)
                self._report("store_error", self._status)
                return True
            logger.warning("transaction failed at completion, rolled back: %s", exc)
            await self._release()
            await self._report.answer(self._send, "store_error", STORE_UNAVAILABLE)
            return False
        if expires_at is not None:
            self._report("new", self._status)
            self._start = {
                **self._start,
                "headers": [*self._start.get("headers", []), expiry_header(expires_at)],
            }
            return True
        if not transactional:
            logger.error("lease lost before completion; the response was not recorded")
            self._report("lease_lost", self._status)
            return True
        await self._report.answer(self._send, "lease_lost", problems.lease_lost())
        return False

    async def _abandon(self) -> None:
        """Stop renewing the lease and roll back, but keep the key reserved."""
        await self._heartbeat.stop()
        await self._txn.close()

    async def _give_up(self) -> None:
        """Roll back the business writes, then free the key for the next retry."""
        await self._heartbeat.stop()
        await self._txn.close()
        await self._release()

    async def _release(self) -> None:
        try:
            await self._store.release(self._lease)
        except StoreError as exc:
            logger.warning(
                "could not release the key; it will be free when its lease lapses: %s", exc
            )

    async def _flush(self, *, more_body: bool = False) -> None:
        assert self._start is not None
        await self._forward(self._start)
        await self._forward(
            {"type": "http.response.body", "body": b"".join(self._chunks), "more_body": more_body}
        )
        self._chunks = []

    async def _forward(self, message: Message) -> None:
        try:
            await self._send(message)
        except OSError:
            # The client went away. The outcome is already recorded; its retry gets the replay.
            self._drop = True
