"""What `verify` found: one finding per property, each with its evidence, as text or JSON."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any


class Status(str, enum.Enum):
    """A property's verdict."""

    PASSED = "passed"
    FAILED = "failed"
    #: the probe ran but could not see the property (no duplicate overlapped the first request)
    UNOBSERVED = "unobserved"
    #: the probe did not run (no second credential given, no way to change the body)
    SKIPPED = "skipped"


class Source(str, enum.Enum):
    """Whose rule a property is: a service that follows the draft can fail only DRAFT ones
    by following it; OURS are idempotency-asgi's own contract on top of it."""

    DRAFT = "draft"
    OURS = "idempotency-asgi"


@dataclass(frozen=True)
class Exchange:
    """One request verify sent and what came back (or the transport error instead)."""

    label: str
    key: str | None
    started: float  # seconds since the run began
    elapsed: float  # seconds until the whole answer was in
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    error: str | None = None

    def header(self, name: str) -> str | None:
        wanted = name.lower()
        return next((value for key, value in self.headers if key.lower() == wanted), None)

    def answer(self) -> tuple[int | None, bytes]:
        return self.status, self.body

    def line(self) -> str:
        """`retry (key verify-…) -> 201, 187 B, sha256 1c82…, in 3 ms, sent at +43 ms`"""
        key = "" if self.key is None else f" (key {self.key})"
        outcome = (
            f"error: {self.error}"
            if self.status is None
            else f"{self.status}, {len(self.body)} B, sha256 {self.digest()}"
        )
        timing = f"in {self.elapsed * 1000:.0f} ms, sent at +{self.started * 1000:.0f} ms"
        return f"{self.label}{key} -> {outcome}, {timing}"

    def digest(self) -> str:
        return hashlib.sha256(self.body).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "key": self.key,
            "started_ms": round(self.started * 1000, 1),
            "elapsed_ms": round(self.elapsed * 1000, 1),
            "status": self.status,
            "headers": [list(pair) for pair in self.headers],
            "body_bytes": len(self.body),
            "body_sha256": hashlib.sha256(self.body).hexdigest(),
            "body": self.body.decode("utf-8", "replace")[:2000],
            "error": self.error,
        }


@dataclass(frozen=True)
class Finding:
    """One property's verdict, with the evidence for it."""

    name: str
    source: Source
    status: Status
    summary: str  # one line: what was seen, and why that is the verdict
    rule: str  # the rule being checked, and where it comes from
    evidence: tuple[str, ...] = ()  # more lines for a person (statuses, headers, timings)
    exchanges: tuple[Exchange, ...] = ()  # every request that is evidence
    #: False: reported, but its failure does not fail the run (ours, under --draft-only)
    required: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source.value,
            "status": self.status.value,
            "required": self.required,
            "summary": self.summary,
            "rule": self.rule,
            "evidence": list(self.evidence),
            "exchanges": [exchange.to_json() for exchange in self.exchanges],
        }


@dataclass(frozen=True)
class Report:
    """Everything `verify` found: one finding per property, in the order they ran."""

    target: dict[str, Any]  # what was probed, and how (method, URL, options)
    findings: tuple[Finding, ...]

    @property
    def passed(self) -> bool:
        """No required property failed."""
        return not self.failed()

    @property
    def exit_status(self) -> int:
        """0: no required property failed (some may be unobserved or skipped); 1: one did."""
        return 0 if self.passed else 1

    def finding(self, name: str) -> Finding:
        """The finding of one property, by its name (`"replay-identical"`)."""
        return next(finding for finding in self.findings if finding.name == name)

    def failed(self, *, required: bool = True) -> list[str]:
        """The properties that failed, of those required (the ones that fail the run) or,
        with `required=False`, of the others."""
        return [
            f.name for f in self.findings if f.status is Status.FAILED and f.required is required
        ]

    def to_json(self) -> dict[str, Any]:
        counts = {status.value: 0 for status in Status}
        for finding in self.findings:
            counts[finding.status.value] += 1
        return {
            "target": self.target,
            "passed": self.passed,
            "exit_status": self.exit_status,
            "counts": counts,
            "properties": [finding.to_json() for finding in self.findings],
        }

    def json(self) -> str:
        """The report as `--json` prints it."""
        return json.dumps(self.to_json(), indent=2)

    def text(self, *, verbose: bool = False) -> str:
        """A heading, then one line per property (status, name, whose rule it is, what was
        seen), each followed by its rule and evidence, indented; `verbose` adds every
        request. The last line counts the statuses and names the failed properties, the ones
        not required apart."""
        target = self.target
        marker = target["replay_marker"] or "none"
        key = "required" if target["key_required"] else "optional"
        draft_only = ", judged by the draft alone" if target.get("draft_only") else ""
        lines = [
            f"verify {target['method']} {target['url']}: {target['concurrency']} concurrent "
            f"duplicates, key {key}, replay marker {marker}{draft_only}"
        ]
        width = max(len(finding.name) for finding in self.findings)
        for finding in self.findings:
            whose = finding.source.value + ("" if finding.required else ", not required")
            lines.append(
                f"{finding.status.value.upper():<10} {finding.name:<{width}}  "
                f"[{whose}] {finding.summary}"
            )
            details = [f"rule: {finding.rule}", *finding.evidence]
            if verbose:
                details += [
                    line for line in (e.line() for e in finding.exchanges) if line not in details
                ]
            lines += [f"    {detail}" for detail in details]
        failed, optional = self.failed(), self.failed(required=False)
        tally = ", ".join(
            f"{sum(f.status is status for f in self.findings)} {status.value}" for status in Status
        )
        if failed:
            verdict = f"FAILED: {', '.join(failed)}"
        else:
            verdict = "no required property failed" if optional else "no property failed"
        if optional:
            verdict += f" (failed, not required: {', '.join(optional)})"
        lines.append(f"{tally}: {verdict}")
        return "\n".join(lines)
