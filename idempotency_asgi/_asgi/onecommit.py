"""An atomic request on the short path, top to bottom: the application runs in the
transaction its claim began (the store's `ShortRun`), its answer is captured, recorded
with its writes in one COMMIT, and only then sent.

The store's two round trips are the claim (already made when this starts) and the record
with its COMMIT (`_settle`). No task, shield or timer is made for a request that succeeds:
a cancelled atomic request leaves nothing to clean up that PostgreSQL does not (its
connection is closed, the server rolls back, the session's locks go), and the store bounds
every step with its one timer. A COMMIT that outlives the timeout is answered 503 at once
(`_late`) and goes on: its retry replays it if it lands.

What an answer becomes, as in the other modes (docs/contract.md): a 2xx/4xx is recorded
and replayed; a 5xx, a release status, a 307 or 308, or an answer the application asks not
to keep (`RELEASE`) rolls back and frees the key, held back until the application returns
(Starlette's error middleware sends its 500 before it re-raises: an OutcomeUnknown raised
behind it must still hold the key); an answer that will not be replayed (an event stream,
`UNREPLAYABLE`, or one past the size cap) is recorded without its body when it starts (or
overflows) and is sent as it comes, the client's disconnect reaching the application.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import problems
from .._errors import (
    HandlerEndedTransaction,
    KeyTaken,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TransactionFailed,
)
from .._keystore import ShortHold
from .._records import HeldReason, StoredResponse, expiry_header_at
from ..problems import Problem
from . import aftercommit
from .context import SCOPE_KEY
from .execution import (
    CONFLICT,
    ENDED_BY_HANDLER,
    IDLE,
    KEY_TAKEN,
    OUTAGE,
    RELEASE,
    STORE_UNAVAILABLE,
    TRANSACTION_CONFLICT,
    TRANSACTION_ENDED,
    TRANSACTION_FAILED,
    UNREPLAYABLE,
    find,
    first,
)
from .outcomes import outcome_unknown_in, recorded, streamed
from .settlement import Settlement
from .telemetry import RequestTelemetry

logger = logging.getLogger("idempotency_asgi")

_RUNNING, _HELD_BACK, _SETTLING, _PASSING, _DROPPING = range(5)

#: How a request whose key is held is reported, by why it is held.
_HELD = {
    HeldReason.OUTCOME_UNKNOWN: Settlement.OUTCOME_UNKNOWN,
    HeldReason.TRANSACTION_ENDED: Settlement.TRANSACTION_ENDED,
    HeldReason.TRANSACTION_IDLE: Settlement.TRANSACTION_IDLE,
}


class Rules:
    """What a middleware's atomic requests share: how answers are kept (built once)."""

    __slots__ = ("excluded", "limit", "on_recorded", "release_statuses", "ttl_us")

    def __init__(
        self,
        *,
        ttl_seconds: float,
        max_stored_bytes: int,
        excluded_headers: frozenset[bytes],
        release_statuses: frozenset[int],
        on_recorded: Callable[[str, float], None],
    ) -> None:
        self.ttl_us = round(ttl_seconds * 1_000_000)
        self.limit = max_stored_bytes
        self.excluded = excluded_headers
        self.release_statuses = release_statuses
        self.on_recorded = on_recorded

    def kept(self, status: int) -> bool:
        """Whether an answer with `status` is the key's outcome (recorded and replayed)."""
        return recorded(status, self.release_statuses)


class AtomicRequest:
    """One request's run on the short path (see the module)."""

    __slots__ = (
        "_answering",
        "_body",
        "_chunks",
        "_client_gone",
        "_limit",
        "_phase",
        "_receive",
        "_recorded_as",
        "_release",
        "_report",
        "_route",
        "_rules",
        "_run",
        "_send",
        "_settled",
        "_size",
        "_start",
        "_started",
    )

    def __init__(
        self,
        run: ShortHold,
        send: Send,
        receive: Receive,
        report: RequestTelemetry,
        rules: Rules,
        *,
        body: bytes,
        route: str,
        recorded_as: Settlement,
    ) -> None:
        self._run = run
        self._send = send
        self._receive = receive
        self._report = report
        self._rules = rules
        self._body: bytes | None = body
        self._route = route
        self._recorded_as = recorded_as
        self._phase = _RUNNING
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = rules.limit
        self._release = False
        self._client_gone = False
        self._settled: asyncio.Event | None = None
        self._answering: asyncio.Future[None] | None = None
        self._started = time.perf_counter()

    async def __call__(self, app: ASGIApp, scope: Scope) -> None:
        try:
            await app({**scope, SCOPE_KEY: self._run}, self._give, self._capture)
        except BaseException as exc:
            if self._phase is _SETTLING:
                # Cut short while recording (cancelled): PostgreSQL decides what the COMMIT
                # did, and the retry is answered by it. The connection is closed if the run
                # had not ended (the server rolls back, and its locks go).
                self._run.abandon()
                self._report(Settlement.RELEASED, 0, f"cut short while recording: {exc!r}")
                raise
            if self._phase in (_PASSING, _DROPPING):
                raise  # after the answer was settled (a background task failed, say)
            await self._failed(exc)
            return
        if self._phase is _HELD_BACK:
            await self._let_go(more_body=False)
        elif self._phase is _RUNNING:
            # The application returned without a whole answer: the server answers 500.
            self._phase = _DROPPING
            verdict = await self._end()
            if verdict is not None:
                settlement, error, answer = verdict
                self._report(settlement, answer.status, error)
                await self._deliver(answer)
                return
            self._report(Settlement.RELEASED, 500)

    # -- what the application is given --------------------------------------------------------

    async def _give(self) -> Message:
        body = self._body
        if body is not None:
            self._body = None
            return {"type": "http.request", "body": body, "more_body": False}
        # Until the answer is settled the request runs to its end, client or no client (its
        # retry wants the replay); after, the client's disconnect is the application's to
        # hear (a stream stops). A COMMIT that outlived the timeout is not settled until it
        # ends: a stream hearing of its client's leaving would cancel it.
        if self._phase is _HELD_BACK:
            # An application that waits for the client after a complete answer will not
            # raise behind it: the answer goes now.
            await self._let_go(more_body=False)
        elif self._phase not in (_PASSING, _DROPPING) or self._answering is not None:
            if self._settled is None:
                self._settled = asyncio.Event()
            await self._settled.wait()
        return await self._receive()

    async def _capture(self, message: Message) -> None:
        phase = self._phase
        if phase is _PASSING:
            await self._forward(message, stream=True)
            return
        if phase is not _RUNNING:
            return  # held back, or the client has another answer
        if message["type"] == "http.response.start":
            if UNREPLAYABLE in message or RELEASE in message:
                if message.get(UNREPLAYABLE):
                    self._limit = -1  # recorded without its body, as if too large to store
                self._release = bool(message.get(RELEASE))
                message = {k: v for k, v in message.items() if k not in (UNREPLAYABLE, RELEASE)}
            self._start = message
            if self._limit < 0 or streamed(message):
                await self._settle(more_body=True, overflow=True)
            return
        if message["type"] != "http.response.body":
            return
        chunk = message.get("body", b"")
        self._chunks.append(chunk)
        self._size += len(chunk)
        more_body = bool(message.get("more_body", False))
        if not more_body:
            await self._settle(more_body=False, overflow=self._size > self._limit)
        elif self._size > self._limit:
            await self._settle(more_body=True, overflow=True)

    # -- settling -----------------------------------------------------------------------------

    async def _settle(self, *, more_body: bool, overflow: bool) -> None:
        """The answer is complete, too large to keep, or a stream starting: record it (with
        the handler's writes, one COMMIT) and send it, or give the key up."""
        start = self._start
        assert start is not None
        status = int(start["status"])
        if self._release or not self._rules.kept(status):
            if not more_body:
                # Until the application returns (see the module); the transaction is closed
                # to it meanwhile, as after any answer.
                self._phase = _HELD_BACK
                self._run.close_to_handler()
                return
            await self._let_go(more_body=True)
            return
        self._phase = _SETTLING
        run = self._run
        if run.ended_by_handler():
            await self._drop(
                *await self._hold(HeldReason.TRANSACTION_ENDED, ENDED_BY_HANDLER), TRANSACTION_ENDED
            )
            return
        if run.broken():
            await run.end()
            await self._drop(Settlement.DATABASE_FAILED, "connection lost", STORE_UNAVAILABLE)
            return
        rules = self._rules
        headers = [
            (bytes(name), bytes(value))
            for name, value in start.get("headers", [])
            if bytes(name).lower() not in rules.excluded
        ]
        body = None if overflow else b"".join(self._chunks)
        response = StoredResponse(status=status, headers=headers, body=body)
        expires_us = round(time.time() * 1_000_000) + rules.ttl_us
        try:
            try:
                await run.record(response, expires_us, self._late)
            except Exception as exc:
                if self._phase is not _DROPPING:
                    raise
                # Answered 503 already: the COMMIT outlived the timeout, and then failed.
                # Nothing is sent again; what is left of the run ends as it would have.
                _landed_late(exc)
                if isinstance(exc, HandlerEndedTransaction):
                    await self._hold(HeldReason.TRANSACTION_ENDED, exc)
                else:
                    await run.close()
                await self._answered_late()
                return
        except HandlerEndedTransaction as exc:
            await self._drop(
                *await self._hold(HeldReason.TRANSACTION_ENDED, exc), TRANSACTION_ENDED
            )
            return
        except TransactionFailed as exc:
            await self._without_transaction(response, expires_us, exc)
            return
        except StoreError as exc:
            if isinstance(exc, StoreRefused):
                answer = problems.store_refused(exc.error)
                await self._drop(Settlement.STORE_REFUSED, exc, answer)
            else:
                await self._drop(Settlement.DATABASE_FAILED, exc, STORE_UNAVAILABLE)
            return
        except KeyTaken as exc:
            await self._drop(Settlement.KEY_TAKEN, exc, KEY_TAKEN)
            return
        if self._phase is _DROPPING:
            _landed_late(None)
            await self._answered_late()
            await aftercommit.run(run.on_commit)  # it committed after all
            return
        rules.on_recorded(self._route, time.perf_counter() - self._started)
        self._start = {
            **start,
            "headers": [*start.get("headers", []), expiry_header_at(expires_us // 1_000_000)],
        }
        settlement = self._recorded_as if body is not None else Settlement.TOO_LARGE_TO_STORE
        self._report(settlement, status)
        self._passing()
        await self._flush(more_body=more_body)
        if run.on_commit:
            if more_body:  # a stream goes on meanwhile
                _background(aftercommit.run(run.on_commit))
            else:
                await aftercommit.run(run.on_commit)

    async def _without_transaction(
        self, response: StoredResponse, expires_us: int, failure: TransactionFailed
    ) -> None:
        """The request's transaction could not commit (rolled back, the locks still held):
        a 4xx is still the application's answer (it caught a database error and said no),
        recorded on its own; a success is not true any more (its writes are gone), unless
        the transaction was READ ONLY; a conflict may pass on a retry."""
        run = self._run
        if failure.transient:
            taken = await run.lost()
            await run.end()
            if taken:
                await self._drop(Settlement.KEY_TAKEN, failure, KEY_TAKEN)
            else:
                await self._drop(Settlement.TRANSACTION_CONFLICT, failure, TRANSACTION_CONFLICT)
            return
        if not (failure.read_only or 400 <= response.status < 500):
            await run.end()
            await self._drop(Settlement.TRANSACTION_FAILED, failure, TRANSACTION_FAILED)
            return
        try:
            written = await run.record_apart(response, expires_us)
        except StoreError as exc:
            answer = (
                problems.store_refused(exc.error)
                if isinstance(exc, StoreRefused)
                else STORE_UNAVAILABLE
            )
            await self._drop(Settlement.DATABASE_FAILED, exc, answer)
            return
        if not written:
            await self._drop(Settlement.KEY_TAKEN, failure, KEY_TAKEN)
            return
        start = self._start
        assert start is not None
        self._start = {
            **start,
            "headers": [*start.get("headers", []), expiry_header_at(expires_us // 1_000_000)],
        }
        if failure.read_only:
            self._report(self._recorded_as, response.status)
        else:
            self._report(Settlement.RECORDED_APART, response.status, failure)
        self._passing()
        await self._flush(more_body=False)

    async def _let_go(self, *, more_body: bool) -> None:
        """An answer that is not the key's outcome: roll back, free the key, send it."""
        self._phase = _SETTLING
        verdict = await self._end()
        if verdict is not None:
            await self._drop(*verdict)
            return
        assert self._start is not None
        self._report(Settlement.RELEASED, int(self._start["status"]))
        self._passing()
        await self._flush(more_body=more_body)

    async def _failed(self, exc: BaseException) -> None:
        """The application raised before its answer was settled: what becomes of the key,
        and what the client is answered (nothing: the server answers 500)."""
        held_back = self._phase is _HELD_BACK
        self._phase = _DROPPING
        run = self._run
        try:
            if run.ended_by_handler():
                settlement, error = await self._hold(HeldReason.TRANSACTION_ENDED, ENDED_BY_HANDLER)
                answer: Problem | None = TRANSACTION_ENDED
            elif (unknown := outcome_unknown_in(exc)) is not None:
                # Neither recorded nor released: held in flight until its lease lapses, so
                # that no retry runs while the first attempt might still take effect.
                settlement, error = await self._hold(HeldReason.OUTCOME_UNKNOWN, repr(unknown))
                answer = (
                    problems.outcome_unknown(run.seconds)
                    if settlement is Settlement.OUTCOME_UNKNOWN
                    else TRANSACTION_ENDED
                )
            else:
                settlement, error, answer = await self._failure(exc)
        except BaseException:
            run.abandon()  # cancelled again, or worse: closing the connection rolls back
            raise
        if answer is None or (not isinstance(exc, Exception) and _being_cancelled()):
            self._report(settlement, 500 if isinstance(exc, Exception) else 0, error)
            if held_back and isinstance(exc, Exception):
                # A complete answer held back (an error middleware's 500): it goes, and the
                # error after it, as it would have without us.
                self._passing()
                await self._flush(more_body=False)
            raise exc
        self._report(settlement, answer.status, error)
        await self._deliver(answer)

    async def _failure(self, exc: BaseException) -> tuple[Settlement, Any, Problem | None]:
        run = self._run
        broken = run.broken()
        verdict = await self._end(exc)
        if verdict is not None:
            return verdict
        if (refused := find(exc, StoreRefused)) is not None:
            return Settlement.STORE_REFUSED, refused, problems.store_refused(refused.error)
        failure = run.failure
        if broken or first(exc, lambda e: isinstance(e, StoreUnavailable) or failure(e) == OUTAGE):
            return Settlement.DATABASE_FAILED, repr(exc), STORE_UNAVAILABLE
        if (conflict := first(exc, lambda e: failure(e) == CONFLICT)) is not None:
            return Settlement.TRANSACTION_CONFLICT, repr(conflict), TRANSACTION_CONFLICT
        return Settlement.RELEASED, repr(exc), None

    async def _end(
        self, exc: BaseException | None = None
    ) -> tuple[Settlement, Any, Problem] | None:
        """Roll back and free the key, for a request that failed (raising `exc`, or with an
        answer that is not kept); hold the key instead, and say what to answer, when the
        handler had ended the transaction itself (a COMMIT or ROLLBACK of its own, found now
        or by the rollback), or when a session that waited on the transaction was cancelled
        and the request failed of it (what that session wrote may have been kept: see
        _postgres/stalls.py)."""
        run = self._run
        if run.ended_by_handler():
            return (
                *await self._hold(HeldReason.TRANSACTION_ENDED, ENDED_BY_HANDLER),
                TRANSACTION_ENDED,
            )
        if run.stalled and (exc is None or first(exc, run.cancelled) is not None):
            held = await self._hold(HeldReason.TRANSACTION_IDLE, IDLE)
            return (*held, problems.transaction_idle(run.idle_seconds))
        try:
            await run.end()
        except HandlerEndedTransaction as exc:
            return (*await self._hold(HeldReason.TRANSACTION_ENDED, exc), TRANSACTION_ENDED)
        return None

    async def _hold(self, reason: HeldReason, error: Any) -> tuple[Settlement, Any]:
        await self._run.hold(reason)
        return _HELD[reason], error

    def _late(self) -> None:
        """The COMMIT outlived the timeout (the store's timer says so): the client is
        answered 503 now, and the COMMIT goes on (its retry replays it if it lands). The
        request waits for the answer to be sent before it returns (`_answered_late`)."""
        if self._phase is not _SETTLING:
            return
        self._phase = _DROPPING
        self._report(Settlement.COMMIT_PENDING, STORE_UNAVAILABLE.status)
        self._answering = _background(self._deliver(STORE_UNAVAILABLE))

    async def _answered_late(self) -> None:
        """The late COMMIT ended: once its 503 is sent, the request is settled (a stream's
        application hears its client from now on)."""
        answering = self._answering
        if answering is not None:
            await answering
            self._answering = None
        if self._settled is not None:
            self._settled.set()

    # -- sending ------------------------------------------------------------------------------

    def _passing(self) -> None:
        self._phase = _PASSING
        if self._settled is not None:
            self._settled.set()

    async def _drop(self, settlement: Settlement, error: Any, answer: Problem) -> None:
        self._phase = _DROPPING
        if self._settled is not None:
            self._settled.set()
        self._report(settlement, answer.status, error)
        await self._deliver(answer)

    async def _flush(self, *, more_body: bool) -> None:
        assert self._start is not None
        await self._forward(self._start, stream=False)
        body: Message = {"type": "http.response.body", "body": b"".join(self._chunks)}
        if more_body:
            body["more_body"] = True
        self._chunks = []
        await self._forward(body, stream=more_body)

    async def _deliver(self, problem: Problem) -> None:
        headers, body = problem.render()
        await self._forward(
            {"type": "http.response.start", "status": problem.status, "headers": headers},
            stream=False,
        )
        await self._forward({"type": "http.response.body", "body": body}, stream=False)

    async def _forward(self, message: Message, *, stream: bool) -> None:
        if self._client_gone:
            if stream:
                raise OSError("the client is gone")
            return
        try:
            await self._send(message)
        except OSError:
            # The client went away. The outcome is settled already, and its retry gets it;
            # a stream's application hears of it, and stops.
            self._client_gone = True
            if stream:
                raise


#: What runs beside the request (a late answer, a stream's after-commit callbacks), kept
#: from the collector.
_BESIDE: set[asyncio.Future[None]] = set()


def _background(work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
    task = asyncio.ensure_future(work)
    _BESIDE.add(task)
    task.add_done_callback(_BESIDE.discard)
    return task


def _landed_late(exc: BaseException | None) -> None:
    if exc is None:
        logger.warning(
            "a COMMIT that outlived the timeout landed: its record is committed, and "
            "retries get its replay"
        )
    elif isinstance(exc, StoreUnavailable):
        logger.warning(
            "a COMMIT that outlived the timeout lost its connection (or was given up on): "
            "whether it landed is PostgreSQL's to say, and a retry reads it: %r",
            exc,
        )
    else:
        logger.warning("a COMMIT that outlived the timeout did not land: %r", exc)


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or bool(cancelling())
