"""Running the application once under a lease, and recording what it answered."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Collection
from datetime import datetime
from typing import NamedTuple, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import problems
from .._errors import (
    CAUSE_LINKS,
    CommitPending,
    HandlerEndedTransaction,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TransactionFailed,
)
from .._keystore import KeyHold
from .._records import HeldReason, StoredResponse, expiry_header
from . import aftercommit
from .context import SCOPE_KEY, HandlerView
from .outcomes import outcome_unknown_in, recorded, streamed
from .settlement import Settlement
from .telemetry import RequestTelemetry

#: Retry-After on a 503: long enough for a failover or a pool to recover, short enough that
#: an automatic retry still looks like the same user action.
STORE_RETRY_AFTER = 2.0

#: A key of `http.response.start`, set true by an application that knows its response may not
#: be whole when it ends (the gateway, for an upstream answer that ends at a close): it is
#: sent as it comes, and recorded without its body, never replayed. Not passed on.
UNREPLAYABLE = "idempotency_asgi.unreplayable"

#: A key of `http.response.start`, set true by an application whose answer must not be
#: stored whatever its status (the gateway, for a tenant the upstream never accepted): the key
#: is freed as for a 5xx, and the answer sent as it is, and logged with its own status. Not
#: passed on.
RELEASE = "idempotency_asgi.release"

#: The answer whenever the store fails a keyed request: nothing ran, or it rolled back.
STORE_UNAVAILABLE = problems.store_unavailable(STORE_RETRY_AFTER)
TRANSACTION_FAILED = problems.transaction_failed()
TRANSACTION_CONFLICT = problems.transaction_conflict(1.0)
TRANSACTION_ENDED = problems.transaction_ended()

#: What the log line says of a request that failed after a session waiting on its idle
#: transaction was cancelled (see _postgres/stalls.py).
IDLE = (
    "a session waited on the request's transaction while it sat idle past "
    "transaction_idle_seconds: its statement was cancelled, and the request failed"
)

#: What the log line says of a request whose handler ended its transaction itself.
ENDED_BY_HANDLER = "the handler committed or rolled back the request's transaction itself"

#: What an exception of the handler's may say of the database (`RequestTransaction.failure`).
OUTAGE, CONFLICT = "outage", "conflict"
#: Atomic mode: another server wrote the key first; its answer is what a retry gets.
KEY_TAKEN = problems.in_flight(1.0)


class Verdict(NamedTuple):
    """How a run ended: its settlement, the problem answered instead of the application's
    answer (None: that answer goes out), and the error that decided it, if one did (it ends
    the request's one log line)."""

    settlement: Settlement
    problem: problems.Problem | None = None
    error: object = None


E = TypeVar("E", bound=BaseException)


def find(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` if it is a `kind`, or the first `kind` inside it when it is an exception group
    (a task group's, asyncio's or anyio's; the `exceptiongroup` backport's on Python 3.10),
    at any depth, or that it was raised from (`raise ... from`, a few links deep)."""
    found = first(exc, lambda inner: isinstance(inner, kind))
    return found if isinstance(found, kind) else None


def first(
    exc: BaseException,
    test: Callable[[BaseException], bool],
    links: int = CAUSE_LINKS,
    seen: set[int] | None = None,
) -> BaseException | None:
    """`exc`, or the first exception inside it (an exception group's) or that it was raised
    from (its `__cause__`, `links` deep), that passes `test`. Each exception is looked at
    once: a member raised from its own group (`except* E as group: raise group.exceptions[0]
    from group`) makes a cycle."""
    seen = set() if seen is None else seen
    if id(exc) in seen:
        return None
    seen.add(id(exc))
    if test(exc):
        return exc
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, (tuple, list)):
        for member in inner:
            if isinstance(member, BaseException) and (
                (found := first(member, test, links, seen)) is not None
            ):
                return found
    cause = exc.__cause__
    if cause is not None and links > 0:
        return first(cause, test, links - 1, seen)
    return None


class Phase(enum.Enum):
    """Where one run stands. Every run ends in PASSING or DROPPING, with its key recorded,
    released, or (OutcomeUnknown, a store that cannot be reached) left to its lease."""

    RUNNING = "running"  # the app runs; its response is captured and held back
    HELD = "held"  # a whole answer the key will not be recorded for: held until the app ends
    SETTLING = "settling"  # the response is complete: being recorded, or the key given up
    PASSING = "passing"  # settled: the rest of the app's messages go to the client
    DROPPING = "dropping"  # settled: the client has another answer, or is gone


class Execution:
    """One request's run: captures the response, then records it or gives the key up.

    The run holds its key by `hold`: a lease (plain and transactional modes) or the request's
    transaction (atomic mode). The response is held back until it is recorded (in the
    transactional and atomic modes: committed), so a client never sees a success whose
    record, or whose business writes, could still be lost.
    A body larger than `max_stored_bytes` is recorded as completed-but-not-replayable at the
    moment it overflows and is then streamed through (see `problems.not_replayable`).
    """

    def __init__(
        self,
        *,
        hold: KeyHold,
        send: Send,
        report: RequestTelemetry,
        ttl_seconds: float,
        max_stored_bytes: int,
        excluded_headers: frozenset[bytes],
        release_statuses: Collection[int],
        recorded_as: Settlement = Settlement.NEW,
        on_recorded: Callable[[float], None] | None = None,
    ) -> None:
        self._hold = hold
        # NEW, EXPIRED or TAKEN_OVER: how the key came to this run, said when it is recorded.
        self._recorded_as = recorded_as
        self._send = send
        self._report = report
        self._ttl = ttl_seconds
        self._limit = max_stored_bytes
        self._excluded = excluded_headers
        self._release_statuses = release_statuses
        self._on_recorded = on_recorded
        self._txn = hold.transaction
        self._view = HandlerView(self._txn)  # what the application reaches it by
        self._phase = Phase.RUNNING
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._client_gone = False
        self._release_anyway = False  # the application asked (see RELEASE)
        self._body: bytes | None = None
        self._receive: Receive | None = None
        #: set once the answer is settled: from then on the client's messages reach the app
        self._settled = asyncio.Event()
        self._started = asyncio.get_running_loop().time()

    async def run(self, app: ASGIApp, scope: Scope, body: bytes, receive: Receive) -> None:
        self._body = body
        self._receive = receive
        self._hold.start()
        try:
            await app({**scope, SCOPE_KEY: self._view}, self._give, self._capture)
        except BaseException as exc:
            held = self._phase is Phase.HELD
            if not held and self._phase is not Phase.RUNNING:
                raise  # after the answer was settled (a background task failed, say)
            self._phase = Phase.DROPPING
            # Shielded: a cancelled request must still roll back and settle its key.
            settlement, problem, error = await asyncio.shield(self._failed(exc))
            if problem is None and held and isinstance(exc, Exception):
                # Its own answer, whole before it raised (the 500 of an error middleware
                # inside): sent as it is, as without this middleware; the server logs the error.
                self._report(settlement, self._status, error)
                self._phase = Phase.PASSING
                await self._flush()
                raise
            if problem is None or (not isinstance(exc, Exception) and _being_cancelled()):
                self._report(settlement, 500 if isinstance(exc, Exception) else 0, error)
                raise  # the server answers 500 (or the task goes on being cancelled)
            self._report(settlement, problem.status, error)
            await self._deliver(problem)
            return
        if self._phase is Phase.HELD:
            await self._settle(more_body=False)  # it returned: the key is freed, as for any 5xx
            return
        if self._phase is Phase.RUNNING:
            # The application returned without a whole response: the server answers 500.
            self._phase = Phase.DROPPING
            ended = await self._ended_by_handler()
            if ended is None and self._txn.stalled:
                ended = await self._held_idle()
            ended = ended or await self._give_up()
            if ended is not None:
                assert ended.problem is not None
                self._report(ended.settlement, ended.problem.status, ended.error)
                await self._deliver(ended.problem)
                return
            self._report(Settlement.RELEASED, 500)

    async def _failed(self, exc: BaseException) -> Verdict:
        """The application raised before its response was complete: decide what becomes of
        the key, and what the client is answered (None: the server's 500)."""
        if (ended := await self._ended_by_handler()) is not None:
            return ended
        if (unknown := outcome_unknown_in(exc)) is not None:
            # Neither recorded nor released: the key stays in flight until its lease lapses,
            # so no retry runs while the first attempt might still take effect. Looked for
            # first, and anywhere behind the exception (see outcomes.py): a task group wraps
            # what its children raise, an application raises its own error while handling
            # one, and releasing the key of an effect that may have happened reruns it.
            await self._hold.stop()
            # Held before the key is let go of: in the atomic mode the request's own session
            # holds it until then, and no retry may slip in between.
            await self._hold.keep(HeldReason.OUTCOME_UNKNOWN)
            await self._txn.close()
            problem = problems.outcome_unknown(self._hold.seconds)
            return Verdict(Settlement.OUTCOME_UNKNOWN, problem, repr(unknown))
        broken = self._txn.broken()  # asked before the transaction ends with the key
        if self._txn.stalled and first(exc, self._txn.cancelled) is not None:
            return await self._held_idle()
        if (ended := await self._give_up()) is not None:
            return ended
        # A StoreError here came from connection(request): the database failed under it.
        if (refused := find(exc, StoreRefused)) is not None:
            return Verdict(Settlement.STORE_REFUSED, problems.store_refused(refused.error), refused)
        failure = self._txn.failure
        if broken or first(exc, lambda e: isinstance(e, StoreUnavailable) or failure(e) == OUTAGE):
            # Its connection broke, the server is going down (an error may come before the
            # socket is seen closed), or connection(request) could not be had.
            return Verdict(Settlement.DATABASE_FAILED, STORE_UNAVAILABLE, repr(exc))
        if (conflict := first(exc, lambda e: failure(e) == CONFLICT)) is not None:
            return Verdict(Settlement.TRANSACTION_CONFLICT, TRANSACTION_CONFLICT, repr(conflict))
        return Verdict(Settlement.RELEASED, None, repr(exc))

    # -- capture ---------------------------------------------------------------------------

    async def _capture(self, message: Message) -> None:
        if self._phase is Phase.PASSING:
            await self._forward(message)
            return
        if self._phase is not Phase.RUNNING:
            return  # the client has another answer, or is gone
        kind = message["type"]
        if kind == "http.response.start":
            if message.get(UNREPLAYABLE) or streamed(message):
                # Recorded without its body, as if it were too large to store: at its first
                # chunk, which an event stream's client waits for.
                self._limit = -1
            if message.get(RELEASE):
                self._release_anyway = True
            if UNREPLAYABLE in message or RELEASE in message:
                message = {k: v for k, v in message.items() if k not in (UNREPLAYABLE, RELEASE)}
            self._start = message
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            self._chunks.append(chunk)
            self._size += len(chunk)
            more_body = bool(message.get("more_body", False))
            if not more_body and self._size <= self._limit and not self._storable():
                # Whole, and not to be recorded (a 5xx, a release status, a 307 or 308): held
                # back until the application returns or raises, since what it raises decides.
                # An error middleware inside this one (Starlette's, when this middleware wraps
                # the app) sends a whole 500 and then raises the OutcomeUnknown that must hold
                # the key: settled at once, the key was free before the exception arrived.
                # Held within the cap on what is stored; a larger answer is settled as it
                # overflows, as any. Its writes roll back whatever comes: what runs after it
                # (a background task) can no longer use the transaction, as after any answer.
                self._phase = Phase.HELD
                self._view.closed = True
            elif not more_body or self._size > self._limit:
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
            settlement, answer, error = await asyncio.shield(deciding)
        except BaseException as exc:
            self._phase = Phase.DROPPING
            if not deciding.done():
                # The request is being cancelled: the decision finishes on its own, and is
                # reported when it does (the client got nothing: status 0).
                deciding.add_done_callback(self._report_late)
            elif not deciding.cancelled() and deciding.exception() is exc:
                self._report(Settlement.RELEASED, 500, repr(exc))  # the server answers 500
            else:
                self._report_late(deciding)  # decided, but cancelled before it resumed
            raise
        self._report(settlement, self._status if answer is None else answer.status, error)
        self._settled.set()
        if answer is None:
            self._phase = Phase.PASSING
            await self._flush(more_body=more_body)
            if settlement in _COMMITTED and self._txn.on_commit:
                # The answer is recorded, and the handler's writes committed with it.
                await aftercommit.run(self._txn.on_commit)
        else:
            self._phase = Phase.DROPPING
            await self._deliver(answer)

    async def _decide(self, *, overflow: bool) -> Verdict:
        """Record the response, or give the key up; return the settlement, and the problem
        to answer with instead of the application's response (None: send that response)."""
        try:
            await self._hold.stop()
            if (ended := await self._ended_by_handler()) is not None:
                return ended
            if self._txn.broken():
                ended = await self._give_up()
                return ended or Verdict(
                    Settlement.DATABASE_FAILED, STORE_UNAVAILABLE, "connection lost"
                )
            if not self._storable():
                if self._txn.stalled:
                    return await self._held_idle()
                return await self._give_up() or Verdict(Settlement.RELEASED)
            if overflow:
                return await self._record(body=None)
            return await self._record(body=b"".join(self._chunks))
        except BaseException:
            # Whatever failed, nothing is left open: roll back, free the key (a no-op once
            # the record is committed, since release only touches an in-flight row).
            await self._give_up()
            raise

    def _report_late(self, deciding: asyncio.Future[Verdict]) -> None:
        if deciding.cancelled():
            return
        failure = deciding.exception()
        if failure is not None:
            # One line for the request, as always: the failure ends it.
            self._report(
                Settlement.RELEASED, 0, f"settling a cancelled request failed: {failure!r}"
            )
            return
        settlement, _, error = deciding.result()
        self._report(settlement, 0, error)

    @property
    def _status(self) -> int:
        assert self._start is not None
        return int(self._start["status"])

    def _storable(self) -> bool:
        return not self._release_anyway and recorded(self._status, self._release_statuses)

    # -- outcomes --------------------------------------------------------------------------

    async def _record(self, *, body: bytes | None) -> Verdict:
        assert self._start is not None
        headers = [
            (bytes(name), bytes(value))
            for name, value in self._start.get("headers", [])
            if bytes(name).lower() not in self._excluded
        ]
        response = StoredResponse(status=self._status, headers=headers, body=body)
        transactional = self._txn.used
        try:
            expires_at = await self._hold.complete(response, ttl_seconds=self._ttl)
        except TransactionFailed as exc:
            return await self._record_without_transaction(response, exc)
        except CommitPending as exc:
            # Not released: the COMMIT goes on and settles the key itself (see the store's
            # _postgres/lending.py).
            return Verdict(Settlement.COMMIT_PENDING, STORE_UNAVAILABLE, exc)
        except HandlerEndedTransaction as exc:
            # What it committed may have happened: held as for OutcomeUnknown, never freed
            # for a retry to run again; answered 500, since retrying cannot make it right.
            await self._hold.keep(HeldReason.TRANSACTION_ENDED)
            await self._txn.close()
            return Verdict(Settlement.TRANSACTION_ENDED, TRANSACTION_ENDED, exc)
        except StoreError as exc:
            if not transactional:
                # Plain mode: the effect has happened whatever we do now. Sending the answer
                # gives the client no reason to retry; the key stays in flight until its
                # lease lapses, after which a retry would run again. (Transactional mode has
                # no such window; this is why it exists.) Marked held, for an operator.
                await self._hold.keep(HeldReason.NOT_RECORDED)
                return Verdict(Settlement.NOT_RECORDED, None, exc)
            await self._release()  # rolled back already
            if isinstance(exc, StoreRefused):
                return Verdict(Settlement.STORE_REFUSED, problems.store_refused(exc.error), exc)
            return Verdict(Settlement.DATABASE_FAILED, STORE_UNAVAILABLE, exc)
        if expires_at is None:
            return self._lost(transactional)
        return Verdict(self._recorded(expires_at, body))

    def _lost(self, transactional: bool) -> Verdict:
        """The key is not this run's any more: taken over after its lease lapsed or, in the
        atomic mode, written by another server first (a deploy that mixes modes)."""
        if self._hold.atomic:
            return Verdict(Settlement.KEY_TAKEN, KEY_TAKEN)
        if not transactional:
            return Verdict(Settlement.LEASE_LOST_PLAIN, None, "not recorded")
        return Verdict(Settlement.LEASE_LOST, problems.lease_lost())

    async def _record_without_transaction(
        self, response: StoredResponse, failure: TransactionFailed
    ) -> Verdict:
        """The request's transaction could not commit. A 4xx is still the application's
        answer (it caught a database error and said no): it is recorded on its own. A success
        is not true any more: the writes it speaks of are gone. Unless the transaction was
        READ ONLY: then there were no writes to lose, whatever it said. The transaction ends
        here (the atomic mode's is still open, holding the key, until this is decided)."""
        try:
            return await self._decide_without_transaction(response, failure)
        finally:
            await self._txn.close()

    async def _decide_without_transaction(
        self, response: StoredResponse, failure: TransactionFailed
    ) -> Verdict:
        if failure.transient:
            if await self._hold.lost():
                # Under REPEATABLE READ or SERIALIZABLE, a completion whose key was taken
                # over meanwhile fails to serialize: that is the lease lost, not a conflict.
                return self._lost(transactional=True)
            # A serialization failure or a deadlock: running it again may well succeed.
            await self._release()
            return Verdict(Settlement.TRANSACTION_CONFLICT, TRANSACTION_CONFLICT, failure)
        if not (failure.read_only or 400 <= response.status < 500):
            await self._release()
            return Verdict(Settlement.TRANSACTION_FAILED, TRANSACTION_FAILED, failure)
        try:
            expires_at = await self._hold.record_apart(response, ttl_seconds=self._ttl)
        except StoreError as exc:
            await self._release()
            if isinstance(exc, StoreRefused):
                return Verdict(Settlement.STORE_REFUSED, problems.store_refused(exc.error), exc)
            return Verdict(Settlement.DATABASE_FAILED, STORE_UNAVAILABLE, exc)
        if expires_at is None:
            # Another owns the key now, and its answer is the one a retry gets: this one
            # (whose writes rolled back) is not final, as for any transactional lease loss.
            return self._lost(transactional=True)
        recorded_as = self._recorded(expires_at, response.body)
        if failure.read_only:
            return Verdict(recorded_as)
        return Verdict(Settlement.RECORDED_APART, None, failure)

    def _recorded(self, expires_at: datetime, body: bytes | None) -> Settlement:
        assert self._start is not None
        if self._on_recorded is not None:
            self._on_recorded(asyncio.get_running_loop().time() - self._started)
        self._start = {
            **self._start,
            "headers": [*self._start.get("headers", []), expiry_header(expires_at)],
        }
        return self._recorded_as if body is not None else Settlement.TOO_LARGE_TO_STORE

    async def _ended_by_handler(self) -> Verdict | None:
        """When the handler ended the request's transaction itself (its own COMMIT or
        ROLLBACK), however it then ends: the key held as for OutcomeUnknown, never freed for
        a retry to run again what it may have committed; the answer a 500 that says so.
        None when it did not."""
        if not self._txn.ended_by_handler():
            return None
        await self._hold.stop()
        await self._hold.keep(HeldReason.TRANSACTION_ENDED)
        await self._txn.close()
        return Verdict(Settlement.TRANSACTION_ENDED, TRANSACTION_ENDED, ENDED_BY_HANDLER)

    async def _abandon(self) -> None:
        """Stop renewing the lease and roll back, but keep the key reserved (in the atomic
        mode the rollback frees it)."""
        await self._hold.stop()
        await self._txn.close()

    async def _give_up(self) -> Verdict | None:
        """Roll back the business writes, then free the key for the next retry; but when the
        rollback finds that the handler had committed the transaction itself (and began
        another), hold the key as `_ended_by_handler` does, and say so."""
        await self._abandon()
        if self._txn.ended_by_handler():
            await self._hold.keep(HeldReason.TRANSACTION_ENDED)
            return Verdict(Settlement.TRANSACTION_ENDED, TRANSACTION_ENDED, ENDED_BY_HANDLER)
        await self._release()
        return None

    async def _held_idle(self) -> Verdict:
        """The request failed after a session that waited on its idle transaction was
        cancelled (see _postgres/stalls.py): held as for OutcomeUnknown, since what that
        session (the handler's own, as a rule) wrote may have been kept; a 500 that says so."""
        await self._hold.stop()
        await self._hold.keep(HeldReason.TRANSACTION_IDLE)
        await self._txn.close()
        problem = problems.transaction_idle(self._txn.idle_seconds)
        return Verdict(Settlement.TRANSACTION_IDLE, problem, IDLE)

    async def _release(self) -> None:
        await self._hold.release()

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
        stream = self._phase is Phase.PASSING and bool(message.get("more_body"))
        if self._client_gone:
            if stream:
                raise OSError("the client is gone")
            return
        try:
            await self._send(message)
        except OSError:
            # The client went away. The outcome is already settled; its retry gets it. A
            # stream's application hears of it, and stops.
            self._client_gone = True
            if stream:
                raise
            self._phase = Phase.DROPPING

    async def _give(self) -> Message:
        """What the application receives: its body (read already), then, once its answer is
        settled, whatever the client sends (its disconnect, which stops a stream); never
        before: until then the request runs to its end, client or no client."""
        body = self._body
        if body is not None:
            self._body = None
            return {"type": "http.request", "body": body, "more_body": False}
        if self._phase is Phase.HELD:
            # An application that waits for its client after a whole answer will not raise
            # behind it: the answer goes now.
            await self._settle(more_body=False)
        elif self._phase in (Phase.RUNNING, Phase.SETTLING):
            await self._settled.wait()
        assert self._receive is not None
        return await self._receive()


#: Settlements whose answer was recorded with the handler's writes (what `after_commit`
#: waits for): not one recorded apart after its transaction failed.
_COMMITTED = frozenset(
    {Settlement.NEW, Settlement.EXPIRED, Settlement.TAKEN_OVER, Settlement.TOO_LARGE_TO_STORE}
)


def _being_cancelled() -> bool:
    """Whether this task is being cancelled (a CancelledError a child raised into a group is
    not that). Python 3.10 cannot tell: there, assume so."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or bool(cancelling())
