"""`idempotency-asgi verify URL ...`: the probes from the command line, a report on stdout.

Exit status: 0 no property failed (some may be unobserved or skipped), 1 a property failed
(with --draft-only: a property of the draft), 2 usage, an unreachable service, or a route that
refuses a fresh request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from .target import DEFAULT_MARKER, PLACEHOLDER, Headers, Target, check_sent_header, parse_header

DESCRIPTION = f"""\
Check a deployed route against the Idempotency-Key contract over real HTTP: a retry is replayed
byte for byte (and marked), the same key with another body gets 422, concurrent duplicates run
once, a missing key gets 400, another credential's same key is its own request, a 409 carries
Retry-After. One line per property, with its evidence.

Every probe uses fresh keys, so the route really runs: of about --concurrency + 12 requests, up
to 8 take effect (more against a service that runs duplicates). Point it at a staging service.
In --body, each {PLACEHOLDER} becomes a fresh value per probe ('v' and 16 hex digits), for routes
that refuse a repeated value.

Exit status: 0 no property failed (some may be unobserved or skipped), 1 a property failed
(with --draft-only: a property of the draft), 2 usage, an unreachable service, or a route that
refuses a fresh request."""


def _headers(option: str, texts: list[str], *, sent: bool = True) -> Headers:
    """The headers given with one option, checked as `Target` checks them; ValueError naming
    the option otherwise. Parsed here, not as an argparse type, whose error would print the
    whole usage text: a usage error is one line."""
    headers = []
    for text in texts:
        try:
            name, value = parse_header(text)
            if sent:
                check_sent_header(name, value)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
        headers.append((name, value))
    return tuple(headers)


def _marker(text: str) -> tuple[str, str] | None:
    if text.strip().lower() == "none":
        return None
    return _headers("--replay-marker", [text], sent=False)[0]


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "verify",
        help="check a deployed service against the Idempotency-Key contract",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", help="the route to probe, e.g. https://staging.example.com/payments")
    parser.add_argument("--method", default="POST", help="the route's method (default: POST)")
    parser.add_argument(
        "-H",
        "--header",
        dest="headers",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="sent with every request (a credential, say); repeatable",
    )
    parser.add_argument(
        "--body",
        default="",
        metavar="TEMPLATE",
        help=f"the request body; {PLACEHOLDER} is replaced",
    )
    parser.add_argument(
        "--changed-body",
        default=None,
        metavar="TEMPLATE",
        help=f"a body the route accepts that differs from --body (default: another {PLACEHOLDER}"
        ", else the first integer member of a JSON object plus one)",
    )
    parser.add_argument(
        "--other-header",
        dest="other_headers",
        action="append",
        default=None,
        metavar="'NAME: VALUE'",
        help="another credential's headers, in place of --header, for the key independence "
        "probe (which runs only with them); repeatable",
    )
    parser.add_argument(
        "--slow-header",
        dest="slow_headers",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="added to the requests meant to be overlapped by a duplicate, to slow the route "
        "(e.g. 'X-Fault-Delay-Ms: 1500' for the example); repeatable",
    )
    parser.add_argument(
        "--concurrency", type=int, default=10, help="concurrent duplicates (default: 10)"
    )
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--key-required",
        dest="key_required",
        action="store_true",
        default=True,
        help="a request without a key must get 400 (the default)",
    )
    keys.add_argument(
        "--key-optional",
        dest="key_required",
        action="store_false",
        help="a request without a key is served as a plain request",
    )
    parser.add_argument(
        "--replay-marker",
        default=": ".join(DEFAULT_MARKER),
        metavar="'NAME: VALUE' | none",
        help="the header that marks a replay (default: idempotency-asgi's "
        f"'{': '.join(DEFAULT_MARKER)}'); none: do not check one",
    )
    parser.add_argument(
        "--draft-only",
        action="store_true",
        help="judge the service by the IETF draft alone: the properties that are "
        "idempotency-asgi's own ([idempotency-asgi]: the replay marker, Retry-After on a 409) "
        "are still run and reported, as not required, and do not decide the exit status",
    )
    parser.add_argument(
        "--quote-key",
        action="store_true",
        help='send the key as an RFC 8941 string ("...") as the draft writes it',
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per request (default: 30)"
    )
    parser.add_argument("--json", action="store_true", help="a machine-readable report")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="list every request in the text report"
    )


def run(args: argparse.Namespace) -> int:
    try:
        other = args.other_headers
        target = Target(
            url=args.url,
            body=args.body,
            method=args.method,
            headers=_headers("-H/--header", args.headers),
            other_headers=None if other is None else _headers("--other-header", other),
            slow_headers=_headers("--slow-header", args.slow_headers),
            changed_body=args.changed_body,
            concurrency=args.concurrency,
            key_required=args.key_required,
            replay_marker=_marker(args.replay_marker),
            quote_key=args.quote_key,
            timeout=args.timeout,
            draft_only=args.draft_only,
        )
    except ValueError as exc:  # a bad URL or header, say: one line, as for an unreachable service
        print(f"idempotency-asgi verify: {exc}", file=sys.stderr)
        return 2
    try:
        from .conformance import verify
        from .sender import VerifyError
    except ImportError as exc:
        print(
            f"idempotency-asgi verify needs httpx: pip install 'idempotency-asgi[verify]' ({exc})",
            file=sys.stderr,
        )
        return 2
    try:
        report = asyncio.run(verify(target))
    except VerifyError as exc:
        print(f"idempotency-asgi verify: {exc}", file=sys.stderr)
        return 2
    print(report.json() if args.json else report.text(verbose=args.verbose))
    return report.exit_status
