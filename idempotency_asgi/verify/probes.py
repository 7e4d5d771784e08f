"""The probes: each sends a few real requests with fresh keys and judges one property from
the answers alone (statuses, bytes, headers), never from how a server names its errors."""

from __future__ import annotations

import asyncio

from .evidence import (
    difference,
    is_marked,
    marker_candidates,
    ms,
    tally,
    valid_retry_after,
    with_problem,
)
from .report import Exchange, Finding, Source, Status
from .sender import Sender, VerifyError
from .target import PLACEHOLDER, Target, new_key, new_unique

REPLAY_RULE = (
    "IETF draft: a retry after the original completed SHOULD get the result of the "
    "completed operation (here: the same status and the same bytes)"
)
MARKER_RULE = (
    "idempotency-asgi marks a replay with Idempotent-Replayed: true; the draft defines no "
    "marker, so a service may use another (--replay-marker 'Name: value') or none "
    "(--replay-marker none)"
)
CHANGED_RULE = (
    "IETF draft: reusing a key with a different request payload SHOULD get 422, and nothing runs"
)
CONCURRENT_RULE = (
    "IETF draft: a duplicate of a request still in progress MUST get a conflict error "
    "(SHOULD be 409), one after it completed its result: the operation runs once"
)
MISSING_REQUIRED_RULE = (
    "IETF draft: a request without Idempotency-Key to an operation that requires one SHOULD "
    "get 400 (--key-required)"
)
MISSING_OPTIONAL_RULE = (
    "the key is optional on this route (--key-optional): a request without one is served "
    "as a plain request; 400 would mean the route requires it"
)
OTHER_RULE = (
    "IETF draft, security considerations: keys are looked up with client-specific "
    "attributes, so another credential's same key is a new request (not a replay, not 422)"
)
RETRY_AFTER_RULE = (
    "idempotency-asgi answers a duplicate in flight with 409 and Retry-After (seconds); "
    "the draft asks for the 409 and says nothing of Retry-After"
)
SLOW_HINT = (
    "point verify at a slower route, or give --slow-header with a header that slows it "
    "(the example payments API: --slow-header 'X-Fault-Delay-Ms: 1500' with "
    "PAYMENTS_FAULT_INJECTION=1)"
)

#: How long the in-flight probe waits between duplicates, and how many it sends at most.
_DUPLICATE_GAP = 0.02
_MAX_DUPLICATES = 50


def _ok(exchange: Exchange) -> bool:
    return exchange.status is not None and 200 <= exchange.status < 300


async def replay(sender: Sender, target: Target) -> list[Finding]:
    """A request and its retry with the same key: the same bytes, marked as a replay. The
    first request of a run, so it also checks that the route accepts the request at all."""
    key = new_key()
    body = target.render(new_unique())
    first = await sender.send("first", key, body)
    if not _ok(first):
        text = " ".join(first.body[:300].decode("utf-8", "replace").split())  # one line
        raise VerifyError(
            f"the route answered {first.status} to a new keyed request, not 2xx: verify needs "
            f"a request the route accepts (check the headers and the body): {text}"
        )
    retry = await sender.send("retry", key, body)
    exchanges = (first, retry)
    evidence = (first.line(), retry.line())
    if retry.answer() == first.answer():
        identical = Finding(
            "replay-identical",
            Source.DRAFT,
            Status.PASSED,
            f"the retry got the first answer byte for byte: {first.status}, "
            f"{len(first.body)} B (first {ms(first.elapsed)}, retry {ms(retry.elapsed)})",
            REPLAY_RULE,
            evidence,
            exchanges,
        )
    else:
        seen = retry.error or difference(first, retry)
        identical = Finding(
            "replay-identical",
            Source.DRAFT,
            Status.FAILED,
            f"the retry got another answer: {seen}",
            REPLAY_RULE,
            evidence,
            exchanges,
        )
    return [identical, _marked(target, first, retry)]


def _marked(target: Target, first: Exchange, retry: Exchange) -> Finding:
    marker = target.replay_marker
    exchanges = (first, retry)
    if marker is None:
        return Finding(
            "replay-marked",
            Source.OURS,
            Status.SKIPPED,
            "no replay marker is checked (--replay-marker none)",
            MARKER_RULE,
            tuple(f"{e.label}: {', '.join(marker_candidates(e)) or '-'}" for e in exchanges),
            exchanges,
        )
    shown = f"{marker[0]}: {marker[1]}"
    if is_marked(first, marker):
        status, summary = Status.FAILED, f"the first answer (not a replay) carries {shown}"
    elif is_marked(retry, marker):
        status, summary = Status.PASSED, f"{shown} on the retry, not on the first answer"
    else:
        others = ", ".join(marker_candidates(retry)) or "none"
        status = Status.FAILED
        summary = f"no {shown} on the retry (headers that might mark it: {others})"
    evidence = tuple(f"{e.label}: {marker[0]}: {e.header(marker[0]) or '-'}" for e in exchanges)
    return Finding("replay-marked", Source.OURS, status, summary, MARKER_RULE, evidence, exchanges)


async def missing_key(sender: Sender, target: Target) -> Finding:
    answer = await sender.send("without a key", None, target.render(new_unique()))
    seen = answer.error or with_problem(answer)
    if target.key_required:
        rule, expected = MISSING_REQUIRED_RULE, answer.status == 400
        summary = f"{seen} without a key" + ("" if expected else ", expected 400")
        if _ok(answer):
            summary += ": the request ran without one"
    else:
        rule = MISSING_OPTIONAL_RULE
        expected = answer.status is not None and answer.status < 500 and answer.status != 400
        summary = f"{seen} without a key" + (
            ": served as a plain request"
            if expected
            else (": the route requires a key (--key-required?)" if answer.status == 400 else "")
        )
    status = Status.PASSED if expected else Status.FAILED
    return Finding("missing-key", Source.DRAFT, status, summary, rule, (answer.line(),), (answer,))


async def changed_body(sender: Sender, target: Target) -> Finding:
    name = "changed-body-422"
    key, unique = new_key(), new_unique()
    changed = target.changed(unique)
    if changed is None:
        return Finding(
            name,
            Source.DRAFT,
            Status.SKIPPED,
            f"no way to change the body: put {PLACEHOLDER} in it or give --changed-body",
            CHANGED_RULE,
        )
    other_body, how = changed
    first = await sender.send("first", key, target.render(unique))
    second = await sender.send("same key, changed body", key, other_body)
    exchanges = [first, second]
    evidence = [f"changed: {how}", first.line(), second.line()]
    if not _ok(first):
        status, summary = Status.FAILED, f"the first request failed: {first.error or first.status}"
    elif second.status == 422:
        control = await sender.send("fresh key, changed body", new_key(), other_body)
        exchanges.append(control)
        evidence.append(control.line())
        if control.status == 422:
            status = Status.UNOBSERVED
            summary = (
                "the route refuses the changed body itself (422 with a fresh key too): give "
                "--changed-body with a body the route accepts"
            )
        else:
            status = Status.PASSED
            summary = (
                f"{with_problem(second)} for the same key with a changed body; the same body "
                f"with a fresh key got {control.status or control.error}, so the 422 was the key's"
            )
    elif second.answer() == first.answer():
        status = Status.FAILED
        summary = (
            f"the first answer ({first.status}) was replayed for a different body: the body "
            "is not part of what the key stands for"
        )
    elif _ok(second):
        status = Status.FAILED
        summary = f"{second.status}: the changed request ran as a new one under a used key"
    else:
        status = Status.FAILED
        summary = f"{second.error or with_problem(second)}, expected 422"
    return Finding(
        name, Source.DRAFT, status, summary, CHANGED_RULE, tuple(evidence), tuple(exchanges)
    )


async def concurrent(
    sender: Sender, target: Target, marker: tuple[str, str] | None
) -> tuple[Finding, list[Exchange]]:
    """N identical requests at once, then one more after they all answered. Returns the
    finding and the 409s seen (for the Retry-After property). `marker` is the replay marker
    when the service was seen to use it: the original is then the one answer without it;
    with None, the answers are judged by their bytes alone."""
    name, n = "concurrent-one-execution", target.concurrency
    key = new_key()
    body = target.render(new_unique())
    duplicates = list(
        await asyncio.gather(
            *(sender.send(f"duplicate {i}/{n}", key, body) for i in range(1, n + 1))
        )
    )
    after = await sender.send("retry after all answered", key, body)
    exchanges = (*duplicates, after)
    conflicts = [e for e in duplicates if e.status == 409]
    answers = [e for e in duplicates if e.status is not None and e.status != 409]
    failed = [e for e in duplicates if e.error]
    ran = [e for e in answers if _ok(e)]  # the original and its replays, if all is well
    # Only a 2xx can be an original: a refusal without the marker ran nothing.
    originals = [e for e in ran if not is_marked(e, marker)]
    distinct = {e.answer() for e in ran}
    spread = max(e.started for e in duplicates) - min(e.started for e in duplicates)
    evidence = [f"{n} sent within {ms(spread)} with one key: {tally(duplicates)}"]
    if answers:
        first = min(answers, key=lambda e: e.started + e.elapsed)
        done = first.started + first.elapsed
        early = sum(e.started < done for e in duplicates if e is not first)
        evidence.append(
            f"{early} of {n - 1} others were sent before the first answer "
            f"({first.status}, {ms(first.elapsed)}) was in"
        )
    if marker is not None:
        evidence.append(f"without {marker[0]}: {len(originals)} (the original)")
    elif target.replay_marker is not None:
        evidence.append(
            f"{target.replay_marker[0]} was not on the replay: answers are judged by their "
            "bytes alone"
        )
    evidence.append(after.line())

    # The first cause that applies is the summary: a second execution (seen by the marker)
    # before anything else; "ran more than once" only then, or on bytes alone when no
    # marker tells an original from a replay that differs.
    refused = [e for e in answers if not _ok(e)]
    status = Status.FAILED
    if marker is not None and len(originals) > 1:
        summary = (
            f"{len(originals)} answers without {marker[0]}: the request ran more than once "
            f"({tally(duplicates)})"
        )
    elif failed:
        summary = f"{len(failed)} of {n} got no answer: {failed[0].error}"
    elif any(e.status is not None and e.status >= 500 for e in answers):
        summary = f"server errors among the duplicates ({tally(duplicates)})"
    elif not answers:
        summary = f"all {n} got 409: none got the original answer"
    elif any(e.status == 422 for e in answers):
        summary = f"identical requests got 422 ({tally(duplicates)}): judged different"
    elif refused:
        summary = (
            f"{len(refused)} of {n} refused ({tally(refused)}): neither the answer, nor a "
            "replay of it, nor 409"
        )
        if any(e.status == 429 for e in refused):
            summary += "; rate limited (a lower --concurrency may stay under the limit)"
    elif marker is not None and not originals:
        summary = f"every answer carries {marker[0]}: none is the original"
    elif len(distinct) > 1 and marker is not None:
        original = originals[0]
        unlike = [e for e in ran if e.answer() != original.answer()]
        summary = (
            f"one execution, but {len(unlike)} of {len(ran) - 1} replays are not "
            f"byte-identical to the original: {difference(original, unlike[0])}"
        )
    elif len(distinct) > 1:
        summary = (
            f"{len(distinct)} different answers among {len(ran)} 2xx answers: the request ran "
            "more than once, or its replays differ from it (no replay marker tells which)"
        )
    elif after.answer() != ran[0].answer():
        summary = f"the retry after all answered got another answer: {difference(ran[0], after)}"
    else:
        status = Status.PASSED
        replays = len(ran) - 1
        summary = (
            f"one execution: 1 original ({ran[0].status}), {replays} identical "
            f"replay{'s' * (replays != 1)}, {len(conflicts)} x 409; the retry afterwards "
            "replayed it"
        )
    finding = Finding(
        name, Source.DRAFT, status, summary, CONCURRENT_RULE, tuple(evidence), exchanges
    )
    return finding, conflicts


async def other_credential(
    sender: Sender, target: Target, marker: tuple[str, str] | None
) -> Finding:
    """The same key and body with another credential's headers. `marker` as in
    `concurrent`."""
    name = "other-credential-independent"
    if target.other_headers is None:
        return Finding(
            name,
            Source.DRAFT,
            Status.SKIPPED,
            "no second credential given (--other-header)",
            OTHER_RULE,
        )
    key = new_key()
    body = target.render(new_unique())
    mine = await sender.send("first credential", key, body)
    theirs = await sender.send("other credential, same key", key, body, other=True)
    exchanges = (mine, theirs)
    evidence = (mine.line(), theirs.line())
    seen = theirs.error or with_problem(theirs)
    status = Status.FAILED
    # It passes only when the other credential's request ran: a 2xx that is not a replay
    # (not marked; where no marker was seen on the retry, not the first answer's bytes). A
    # 409, a 422 or a replay is the first credential's key showing through; any other
    # refusal means the request never ran, and shows nothing either way.
    if not _ok(mine):
        summary = f"the first credential's request failed: {mine.error or mine.status}"
    elif theirs.status == 409:
        summary = "409: held as a duplicate of the first credential's request"
    elif theirs.status == 422:
        summary = f"{seen}: the key counted as reused across credentials"
    elif theirs.status is None or theirs.status >= 500:
        summary = f"the other credential's request failed: {seen}"
    elif is_marked(theirs, marker):
        summary = "marked as a replay: the first credential's answer was replayed to it"
    elif not _ok(theirs):
        status = Status.UNOBSERVED
        hint = "rate limited: try again later" if theirs.status == 429 else "check --other-header"
        summary = (
            f"the other credential was refused ({seen}): its request did not run, so nothing "
            f"shows whether the key is its own ({hint})"
        )
    elif theirs.answer() == mine.answer() and marker is None:
        summary = "byte-identical to the first credential's answer: replayed across credentials?"
    else:
        status = Status.PASSED
        same = theirs.answer() == mine.answer()
        summary = f"ran on its own: {theirs.status}, " + (
            "the same bytes but not marked (the route may answer alike for the same input)"
            if same
            else "not the first credential's answer"
        )
    return Finding(name, Source.DRAFT, status, summary, OTHER_RULE, evidence, exchanges)


async def in_flight(sender: Sender, target: Target) -> tuple[list[Exchange], list[str]]:
    """A request (slowed with the slow headers, if any) and duplicates of it while it runs,
    until one gets 409 or the first answers. Returns the exchanges and what they show."""
    key = new_key()
    body = target.render(new_unique())
    first_task = asyncio.create_task(sender.send("first (in flight)", key, body, slow=True))
    duplicates: list[Exchange] = []
    try:
        for attempt in range(1, _MAX_DUPLICATES + 1):
            await asyncio.sleep(_DUPLICATE_GAP)
            if first_task.done():
                break
            duplicate = await sender.send(f"in-flight duplicate {attempt}", key, body, slow=True)
            duplicates.append(duplicate)
            if duplicate.status == 409:
                break
        first = await first_task
    finally:
        first_task.cancel()
    notes = [first.line(), *(duplicate.line() for duplicate in duplicates)]
    return [first, *duplicates], notes


def retry_after(conflicts: list[Exchange], probe: list[Exchange], notes: list[str]) -> Finding:
    """Judged on every 409 any probe saw."""
    name = "retry-after-on-409"
    seen = [*conflicts, *(e for e in probe if e.status == 409)]
    exchanges = tuple(dict.fromkeys([*seen, *probe]))
    if not seen:
        first = probe[0]
        done = first.started + first.elapsed
        during = [d for d in probe[1:] if d.status is not None and d.started < done]
        if any(d.answer() == first.answer() for d in during):
            why = (
                "a duplicate sent while the first ran got the first's answer once it finished "
                "(a server that holds duplicates instead of answering 409, or one that arrived "
                "just after)"
            )
        elif during:
            why = (
                f"a duplicate sent while the first ran got an answer of its own "
                f"({during[0].status}), not 409"
            )
        else:
            why = (
                f"no duplicate overlapped the first request (it answered in "
                f"{ms(first.elapsed)}); {SLOW_HINT}"
            )
        return Finding(
            name,
            Source.OURS,
            Status.UNOBSERVED,
            f"no 409 seen: {why}",
            RETRY_AFTER_RULE,
            tuple(notes),
            exchanges,
        )
    values = [e.header("retry-after") for e in seen]
    bad = [v for v in values if not valid_retry_after(v)]
    shown = ", ".join(sorted({"absent" if v is None else repr(v) for v in values}))
    if bad:
        status = Status.FAILED
        summary = f"{len(bad)} of {len(seen)} 409 answers without a valid Retry-After ({shown})"
    else:
        status = Status.PASSED
        summary = f"{len(seen)} x 409 seen, each with Retry-After ({shown})"
    origin = (
        f"409s: {len(conflicts)} among the concurrent duplicates, "
        f"{len(seen) - len(conflicts)} in the in-flight probe"
    )
    evidence = (origin, *notes)
    return Finding(name, Source.OURS, status, summary, RETRY_AFTER_RULE, evidence, exchanges)
