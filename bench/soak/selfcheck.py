"""`python -m bench.soak --self-check`: the auditor is not vacuous.

Builds a clean fabricated run (a small plan of every kind of key, the answers a correct server
gives, the ledger a correct database holds), checks that the audit passes it, then breaks it
one way at a time (a replay with other bytes, a second payment, a payment for a released key, a
409 without Retry-After, a delayed copy that ran again...) and checks that the audit fails
with the violation that names it. Exits 1 if a broken run passes or a clean one fails.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

from .audit import ALONGSIDE, FIRST, INJECTED, LATER, Answer, Ledger, audit
from .plan import CONCURRENT, DELAYED, FAULT, SINGLE, Job, counts, jobs

Run = tuple[list[Answer], Ledger]


def _digest(job: Job) -> bytes:
    return hashlib.sha256(b"201 body of " + job.key.encode() + job.tenant.encode()).digest()


def _payment(job: Job) -> str:
    return f"pay_{job.index:024x}"


def clean_run(plan: list[Job]) -> Run:
    answers: list[Answer] = []
    ledger = Ledger(payments={}, fault_rows={}, stored={}, in_flight=0)
    for job in plan:
        where = (job.tenant, job.key)
        if job.kind == FAULT:
            answers.append(Answer(job.index, FIRST, 1.0, 0.01, 500, problem=INJECTED))
            continue
        original = Answer(
            job.index, FIRST, 1.0, 0.01, 201, digest=_digest(job), payment_id=_payment(job)
        )
        if job.kind == CONCURRENT:
            original.copy = ALONGSIDE
            answers.append(original)
            for number in range(1, job.copies):
                if number == 1:
                    answers.append(Answer(job.index, ALONGSIDE, 1.0, 0.01, 409, retry_after=b"1"))
                else:
                    answers.append(
                        Answer(job.index, ALONGSIDE, 1.0, 0.01, 201, True, digest=_digest(job))
                    )
        else:
            answers.append(original)
        if job.kind == DELAYED:
            answers.append(Answer(job.index, LATER, 5.0, 0.01, 201, True, digest=_digest(job)))
        ledger.payments[where] = [(_payment(job), 1)]
        if job.index % 3 == 0:  # a third not reaped yet
            ledger.stored[where] = _digest(job)
    return answers, ledger


def _first(plan: list[Job], kind: str, copies: int = 0) -> Job:
    return next(j for j in plan if j.kind == kind and (not copies or j.copies == copies))


def breakages(plan: list[Job]) -> list[tuple[str, str, Callable[[Run], None]]]:
    single = _first(plan, SINGLE)
    triple = _first(plan, CONCURRENT, 3)
    delayed = _first(plan, DELAYED)
    fault = _first(plan, FAULT)

    def answers_of(run: Run, job: Job) -> list[Answer]:
        return [a for a in run[0] if a.job == job.index]

    def where(job: Job) -> tuple[str, str]:
        return (job.tenant, job.key)

    def replay_differs(run: Run) -> None:
        answers_of(run, delayed)[1].digest = hashlib.sha256(b"other bytes").digest()

    def second_payment(run: Run) -> None:
        run[1].payments[where(single)].append(("pay_second", 1))

    def released_paid(run: Run) -> None:
        run[1].payments[where(fault)] = [("pay_ghost", 1)]

    def released_held(run: Run) -> None:
        run[1].fault_rows[where(fault)] = "in_flight"

    def conflict_without_hint(run: Run) -> None:
        next(a for a in answers_of(run, triple) if a.status == 409).retry_after = None

    def store_unavailable(run: Run) -> None:
        a = answers_of(run, single)[0]
        a.status, a.problem, a.digest = 503, "urn:idempotency-asgi:problem:store-unavailable", None
        run[1].payments.pop(where(single))

    def ran_again(run: Run) -> None:
        later = answers_of(run, delayed)[1]
        later.replayed, later.payment_id = False, "pay_again"
        later.digest = hashlib.sha256(b"another payment").digest()
        run[1].payments[where(delayed)].append(("pay_again", 1))

    def only_conflicts(run: Run) -> None:
        for a in answers_of(run, triple):
            a.status, a.replayed, a.retry_after, a.digest = 409, False, b"1", None
        run[1].payments.pop(where(triple))

    def conflicts_but_paid(run: Run) -> None:
        only_conflicts(run)
        run[1].payments[where(triple)] = [("pay_unseen", 1)]

    def payment_lost(run: Run) -> None:
        run[1].payments.pop(where(single))

    def other_payment(run: Run) -> None:
        run[1].payments[where(single)] = [("pay_someone_else", 1)]

    def no_event(run: Run) -> None:
        run[1].payments[where(single)] = [(_payment(single), 0)]

    def stranger(run: Run) -> None:
        run[1].payments[("acme", "not-sent")] = [("pay_stranger", 1)]

    def no_answer(run: Run) -> None:
        a = answers_of(run, single)[0]
        a.status, a.error = 0, "ProtocolError: connection closed before the answer was complete"

    def stored_differs(run: Run) -> None:
        key = next(iter(run[1].stored))
        run[1].stored[key] = hashlib.sha256(b"stored other bytes").digest()

    def stuck(run: Run) -> None:
        run[1].in_flight = 1

    def fault_ran(run: Run) -> None:
        a = answers_of(run, fault)[0]
        a.status, a.problem, a.payment_id = 201, None, "pay_fault"

    def reused(run: Run) -> None:
        a = answers_of(run, single)[0]
        a.status, a.problem = 422, "urn:idempotency-asgi:problem:key-reused"
        run[1].payments.pop(where(single))

    def lost_request(run: Run) -> None:
        run[0].remove(answers_of(run, delayed)[1])

    return [
        ("a replay with other bytes", "replay-mismatch", replay_differs),
        ("two payments for one key", "several-payments", second_payment),
        ("a payment for a released (500) key", "payment-for-released-key", released_paid),
        ("a released key still in the table", "released-key-still-held", released_held),
        ("a 409 without Retry-After", "409-without-retry-after", conflict_without_hint),
        ("a 503 that was not injected", "unexpected-5xx", store_unavailable),
        ("a delayed copy that ran again", "delayed-not-replayed", ran_again),
        ("... which is also a second original", "several-originals", ran_again),
        ("a key that only ever saw 409", "no-original", only_conflicts),
        ("... with a payment all the same", "payment-without-original", conflicts_but_paid),
        ("an original 201 with no payment", "payment-missing", payment_lost),
        ("a payment other than the one answered", "payment-id-differs", other_payment),
        ("a payment without its outbox event", "outbox-events", no_event),
        ("a payment for a key never sent", "payment-for-unknown-key", stranger),
        ("a request without an answer", "no-answer", no_answer),
        ("a stored body other than the answer", "stored-response-differs", stored_differs),
        ("a key left in flight", "in-flight-at-end", stuck),
        ("a fault key that answered 201", "fault-answer", fault_ran),
        ("a 422 for a faithful retry", "unexpected-status", reused),
        ("a planned request never recorded", "requests-sent", lost_request),
    ]


def main() -> int:
    plan = jobs("selfcheck", counts(400, 0.10, 5), seed=7)
    clean = clean_run(plan)
    verdict = audit(plan, *clean)
    failures = 0
    print(f"clean fabricated run ({len(clean[0])} answers): ", end="")
    if verdict.passed:
        print("audit passes")
    else:
        failures += 1
        print(f"audit FAILS, wrongly: {verdict.by_check()}")
    for description, check, breakage in breakages(plan):
        run = copy.deepcopy(clean)
        breakage(run)
        found = audit(plan, *run).by_check()
        caught = check in found
        failures += not caught
        print(f"  {'caught' if caught else 'MISSED'}  {description:<42} -> {found}")
    print("self-check passed" if not failures else f"self-check FAILED ({failures})")
    return 1 if failures else 0
