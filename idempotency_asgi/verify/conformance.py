"""`verify()`: every probe against one route, in order, and the report."""

from __future__ import annotations

from dataclasses import replace

import httpx

from .probes import changed_body, concurrent, in_flight, missing_key, other_credential, replay
from .probes import retry_after as retry_after_finding
from .report import Finding, Report, Source, Status
from .sender import Sender
from .target import Target


async def verify(target: Target, *, transport: httpx.AsyncBaseTransport | None = None) -> Report:
    """Probe the route over HTTP and judge each property from the answers.

    Every probe uses fresh keys, so the route really runs: of about `concurrency` + 12
    requests, up to 8 take effect (payments made, orders placed; more against a service that
    runs duplicates). Point it at a staging service.

    Raises VerifyError when nothing can be judged: the service cannot be reached, or it
    refuses a fresh keyed request (not 2xx). `transport` replaces the network (for instance
    `httpx.ASGITransport(app)` to verify an application in process).
    """
    limits = httpx.Limits(
        max_connections=target.concurrency + 2, max_keepalive_connections=target.concurrency + 2
    )
    async with httpx.AsyncClient(
        timeout=target.timeout, limits=limits, transport=transport, follow_redirects=False
    ) as client:
        sender = Sender(client, target)
        findings: list[Finding] = await replay(sender, target)
        # The marker is ours: the draft's properties lean on it only once the service has
        # been seen to use it, and are judged by bytes alone otherwise.
        marked = findings[1].status is Status.PASSED
        marker = target.replay_marker if marked else None
        findings.append(await changed_body(sender, target))
        concurrent_finding, conflicts = await concurrent(sender, target, marker)
        findings.append(concurrent_finding)
        findings.append(await missing_key(sender, target))
        findings.append(await other_credential(sender, target, marker))
        probe, notes = await in_flight(sender, target)
        findings.append(retry_after_finding(conflicts, probe, notes))
    if target.draft_only:  # ours are still reported, for what they show, but decide nothing
        findings = [replace(f, required=False) if f.source is Source.OURS else f for f in findings]
    return Report(target.describe(), tuple(findings))
