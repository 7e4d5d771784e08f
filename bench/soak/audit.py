"""The soak's audit: every answer the client got, against what the database holds afterwards.

Pure functions over plain data (`Answer`s and a `Ledger`), so that `selfcheck.py` can feed it
fabricated runs with one fault each and show that each is caught. The rules:

- every request got an answer (a connection that closed mid-request is a violation);
- a fault key (X-Fault-Status: 500) got exactly the injected 500 and has no payment, no outbox
  event, and no row in idempotency_keys (it was released);
- every other key got exactly one original (a 201 without `Idempotent-Replayed`), and every
  other answer for it is a replay byte-identical to that original (same sha256 of the body) or,
  for a concurrent copy only, a 409 carrying a positive integer `Retry-After`; a delayed copy is
  always a replay;
- no other status at all (no 5xx but the injected ones, no 422, no 503);
- the payments table holds exactly one payment per key that got an original, with the id that
  original's body names, and each payment exactly one outbox event; none for a key that never
  got an original; none for a key the run did not send;
- a finished key the reaper has not deleted yet stores the body the client got (same sha256);
- nothing is left in flight at the end.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .plan import CONCURRENT, DELAYED, FAULT, Job

INJECTED = "urn:payments-example:problem:injected-fault"

# A copy of a key's request: the first (or the only) one, one sent alongside it, or one sent later.
FIRST, ALONGSIDE, LATER = "first", "alongside", "later"


@dataclass(slots=True)
class Answer:
    job: int  # Job.index
    copy: str  # FIRST, ALONGSIDE or LATER
    sent_at: float  # seconds since the run began
    latency: float  # seconds; 0 when there was no answer
    status: int = 0  # 0: no answer (see error)
    replayed: bool = False
    retry_after: bytes | None = None
    digest: bytes | None = None  # sha256 of the body
    payment_id: str | None = None  # from an original 201's body
    problem: str | None = None  # `type` of a problem+json body
    error: str | None = None  # why there is no answer


@dataclass
class Ledger:
    """What the database holds for the run's keys once the load is over."""

    #: (tenant, key) -> [(payment id, outbox events for it)]
    payments: dict[tuple[str, str], list[tuple[str, int]]]
    #: (tenant, key) -> state of a fault key's row still in idempotency_keys
    fault_rows: dict[tuple[str, str], str]
    #: (tenant, key) -> sha256 of the stored response body, for finished rows not yet reaped
    stored: dict[tuple[str, str], bytes]
    #: rows of idempotency_keys still in flight after every request was answered
    in_flight: int


@dataclass
class Violation:
    check: str
    tenant: str
    key: str
    detail: str


@dataclass
class Audit:
    counts: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    def by_check(self) -> dict[str, int]:
        return dict(Counter(v.check for v in self.violations))

    def summary(self, examples: int = 20) -> dict[str, Any]:
        shown: dict[str, list[dict[str, str]]] = defaultdict(list)
        for v in self.violations:
            if len(shown[v.check]) < examples:
                shown[v.check].append({"tenant": v.tenant, "key": v.key, "detail": v.detail})
        return {
            "passed": self.passed,
            "counts": self.counts,
            "statuses": self.statuses,
            "violations": self.by_check(),
            "violation_examples": dict(shown),
        }


def audit(jobs: Sequence[Job], answers: Iterable[Answer], ledger: Ledger) -> Audit:
    result = Audit()
    bad = result.violations
    per_job: list[list[Answer]] = [[] for _ in jobs]
    statuses: Counter[str] = Counter()
    for answer in answers:
        per_job[answer.job].append(answer)
        statuses[str(answer.status) if answer.status else "no answer"] += 1
    result.statuses = dict(sorted(statuses.items()))

    c: Counter[str] = Counter()
    sent_keys = set()
    for job, got in zip(jobs, per_job, strict=True):
        where = (job.tenant, job.key)
        sent_keys.add(where)
        c["requests"] += len(got)
        c["keys"] += 1
        c[f"keys_{job.kind}"] += 1

        def violation(check: str, detail: str, job: Job = job) -> None:
            bad.append(Violation(check, job.tenant, job.key, detail))

        if len(got) != job.requests:
            violation("requests-sent", f"{len(got)} requests recorded, {job.requests} planned")
        for a in got:
            if a.status == 0:
                violation("no-answer", f"{a.copy} copy at {a.sent_at:.3f}s: {a.error}")
        answered = [a for a in got if a.status]
        payments = ledger.payments.get(where, [])
        c["payments"] += len(payments)
        for payment_id, events in payments:
            c["outbox_events"] += events
            if events != 1:
                violation("outbox-events", f"payment {payment_id} has {events} outbox events")

        if job.kind == FAULT:
            for a in answered:
                if a.status == 500 and a.problem == INJECTED:
                    c["injected_500"] += 1
                else:
                    violation("fault-answer", f"status {a.status} ({a.problem}), not the fault")
            if payments:
                violation(
                    "payment-for-released-key",
                    f"{len(payments)} payment(s) {[p for p, _ in payments]} for a key"
                    " whose request answered 500",
                )
            if where in ledger.fault_rows:
                violation(
                    "released-key-still-held",
                    f"idempotency_keys still has the row ({ledger.fault_rows[where]})",
                )
            continue

        originals = [a for a in answered if a.status == 201 and not a.replayed]
        for a in answered:
            if a.status == 201:
                c["replays" if a.replayed else "originals"] += 1
                if a.replayed:
                    c[f"replays_{a.copy}"] += 1
            elif a.status == 409:
                c["conflicts_409"] += 1
                if a.copy != ALONGSIDE:
                    violation("409-not-concurrent", f"a 409 for the {a.copy} copy")
                if not (a.retry_after and a.retry_after.isdigit() and int(a.retry_after) >= 1):
                    violation("409-without-retry-after", f"Retry-After {a.retry_after!r}")
            elif a.status >= 500:
                violation("unexpected-5xx", f"{a.status} ({a.problem}) for the {a.copy} copy")
            else:
                violation("unexpected-status", f"{a.status} ({a.problem}) for the {a.copy} copy")
        if job.kind == CONCURRENT:
            c["concurrent_copies_409"] += sum(1 for a in answered if a.status == 409)
        if job.kind == DELAYED:
            for a in answered:
                if a.copy == LATER and not (a.status == 201 and a.replayed):
                    violation(
                        "delayed-not-replayed",
                        f"the copy sent {a.sent_at:.3f}s got {a.status}"
                        f"{' (an original: the key ran again)' if a.status == 201 else ''}",
                    )

        if len(originals) == 0:
            c["keys_without_original"] += 1
            violation("no-original", "no answer was an original 201")
        elif len(originals) > 1:
            violation(
                "several-originals",
                f"{len(originals)} originals: payments {[a.payment_id for a in originals]}",
            )
        first = originals[0] if originals else None
        for a in answered:
            if a.status == 201 and a.replayed:
                if first is None:
                    violation("replay-without-original", f"a replay for the {a.copy} copy")
                elif a.digest != first.digest:
                    c["replay_mismatches"] += 1
                    violation(
                        "replay-mismatch",
                        f"the {a.copy} copy's replay body differs from the original's"
                        f" (sha256 {_hex(a.digest)} vs {_hex(first.digest)})",
                    )

        expected = sorted(str(a.payment_id) for a in originals)
        found = sorted(p for p, _ in payments)
        if found != expected:
            if not originals:
                check = "payment-without-original"
            elif len(found) > len(expected):
                check = "several-payments"
            elif len(found) < len(expected):
                check = "payment-missing"
            else:
                check = "payment-id-differs"
            violation(check, f"payments in the database {found}, originals answered {expected}")
        if first is not None and where in ledger.stored and ledger.stored[where] != first.digest:
            violation(
                "stored-response-differs",
                f"stored body sha256 {_hex(ledger.stored[where])}, answered {_hex(first.digest)}",
            )
        if where in ledger.stored:
            c["stored_rows_checked"] += 1

    for where, payments in ledger.payments.items():
        if where not in sent_keys:
            c["payments"] += len(payments)
            bad.append(
                Violation(
                    "payment-for-unknown-key",
                    where[0],
                    where[1],
                    f"{len(payments)} payment(s) for a key the run never sent",
                )
            )
    if ledger.in_flight:
        bad.append(
            Violation("in-flight-at-end", "*", "*", f"{ledger.in_flight} rows still in flight")
        )
    for name in ("replay_mismatches", "keys_without_original", "injected_500", "conflicts_409"):
        c.setdefault(name, 0)
    result.counts = dict(sorted(c.items()))
    return result


def _hex(digest: bytes | None) -> str:
    return digest.hex()[:16] if digest else "none"
