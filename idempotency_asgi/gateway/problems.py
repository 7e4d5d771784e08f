"""The gateway's own problem answers (RFC 9457), next to the middleware's. The `type` values
are stable (`urn:idempotency-asgi:problem:<name>`); each `detail` says what to do."""

from __future__ import annotations

from ..problems import Problem


def upstream_unavailable(reason: str) -> Problem:
    return Problem(
        502,
        "upstream-unavailable",
        "The upstream service could not be reached",
        f"The gateway could not send the request to the upstream ({reason}); nothing was "
        "sent, so nothing happened. Retry, with the same Idempotency-Key if it had one.",
        retry_after=1,
    )


def upstream_failed() -> Problem:
    return Problem(
        502,
        "upstream-failed",
        "The upstream service failed to answer",
        "The connection to the upstream broke after the request was sent and before its "
        "answer arrived; the request may or may not have taken effect. Send it with an "
        "Idempotency-Key to make retrying it safe.",
    )


def upstream_timeout(seconds: float) -> Problem:
    return Problem(
        504,
        "upstream-timeout",
        "The upstream service did not answer in time",
        f"The upstream sent nothing for {seconds:g} s and the request was abandoned; it may "
        "or may not have taken effect. Send it with an Idempotency-Key to make retrying it "
        "safe.",
    )


def answer_invalid(reason: str, status: int, *, recorded: bool) -> Problem:
    """The upstream answered, with something that cannot be passed on as it came."""
    if recorded:
        outcome = (
            f"The request reached the upstream, which answered {status}: its key is settled as "
            "the middleware settles that status (recorded without a body to replay when it "
            "is stored, so a retry with the same key gets 409 response-not-replayable with "
            "that status and runs nothing). Do not send it again under another key."
        )
    else:
        outcome = (
            "The request reached the upstream and may have taken effect; send it with an "
            "Idempotency-Key to make retrying it safe."
        )
    return Problem(
        502,
        "upstream-answer-invalid",
        "The upstream's answer cannot be passed on",
        f"The upstream's answer holds {reason}, which the gateway will not pass on or record "
        f"as it came (RFC 9110, RFC 9112). {outcome}",
        extra={"upstream_status": status},
    )


def http10_answer_too_large(status: int, limit: int) -> Problem:
    """An answer without a length, held for an HTTP/1.0 client, past what the gateway holds."""
    return Problem(
        502,
        "answer-too-large-for-http10",
        "The answer is too large to send to an HTTP/1.0 client",
        f"The upstream answered {status} without a length, and an HTTP/1.0 client can only "
        "read a body whose length it is told: the gateway holds such an answer until it is "
        f"whole, up to {limit} bytes, and this one is larger. The request reached the "
        "upstream: with an Idempotency-Key its outcome is recorded, and a retry with the same "
        "key over HTTP/1.1 replays the answer if it was stored (within the bound on stored "
        "answers), or gets 409 response-not-replayable; without one it may have taken "
        "effect.",
        extra={"upstream_status": status, "limit": limit},
    )


#: On every refusal made before the body was read: the connection is not reused, so nothing
#: the client sent after the head (a body, or what it framed as one) is read as a request.
_CLOSE = ((b"connection", b"close"),)


def still_running(seconds: float, retry_after: float) -> Problem:
    return Problem(
        504,
        "upstream-still-running",
        "The upstream service has not answered yet",
        f"The upstream has not answered within {seconds:g} s. The request goes on, and its "
        "answer will be recorded: retry with the same Idempotency-Key after Retry-After "
        "seconds to receive it (meanwhile a retry gets 409 and runs nothing).",
        retry_after=retry_after,
    )


def cannot_forward(reason: str) -> Problem:
    return Problem(
        400,
        "cannot-forward",
        "The request cannot be forwarded",
        f"The gateway cannot forward this request as it was sent ({reason}); nothing was "
        "sent. Fix the request and send it again.",
        headers=_CLOSE,
    )


def dot_segment(*, encoded_separator: bool = False) -> Problem:
    """`encoded_separator`: not a dot segment, but a `%2F` or `%5C` on a path exempt from keys
    only when it is read as a separator."""
    if encoded_separator:
        detail = (
            "The path holds an encoded separator (%2F or %5C) and is exempt from keys only when "
            "it is read as a separator, which some servers do and others do not: the gateway "
            "cannot know which path the upstream would run; nothing was sent. Send the path "
            "with the separator as it is meant, unencoded or not at all."
        )
    else:
        detail = (
            'The path holds a dot segment ("." or "..") in some server\'s reading of it (its '
            'dots or the "/" before them percent-encoded, after a "\\", or followed by '
            '";params"), which the upstream could resolve to another path than the one the '
            "gateway checked; nothing was sent. Send the normalized path instead, with every "
            "dot segment resolved (RFC 3986, section 5.2.4)."
        )
    return Problem(
        400,
        "path-not-normalized",
        "The request path is not normalized",
        detail,
        headers=_CLOSE,
    )


def health_method_not_allowed(path: str) -> Problem:
    return Problem(
        405,
        "health-method-not-allowed",
        "The health check answers GET and HEAD only",
        f"{path} is the gateway's own health check and is never forwarded; ask it with GET "
        "or HEAD.",
        headers=((b"allow", b"GET, HEAD"),),
    )


def ambiguous_framing() -> Problem:
    return Problem(
        400,
        "ambiguous-framing",
        "The request body is framed twice",
        "The request has both Content-Length and Transfer-Encoding, so where its body ends "
        "depends on who reads it (RFC 9112, section 6.1); nothing was forwarded and the "
        "connection is closed. Send one of the two.",
        headers=_CLOSE,
    )


def headers_too_large(reason: str) -> Problem:
    return Problem(
        431,
        "headers-too-large",
        "Request header fields too large",
        f"The request's header section is too large ({reason}); nothing was forwarded. Send "
        "fewer or smaller headers.",
        headers=_CLOSE,
    )


def repeated_header(name: str) -> Problem:
    return Problem(
        400,
        "repeated-header",
        "A header that must appear once appears more than once",
        f"The request carries {name} more than once, and the gateway will not guess which "
        "one counts; nothing was forwarded. Send it once.",
        headers=_CLOSE,
    )


def connection_names(name: str) -> Problem:
    return Problem(
        400,
        "connection-names-end-to-end-header",
        "The Connection header names a header the request depends on",
        f"Connection names {name}, which would make it hop-by-hop and strip it on the way to "
        "the upstream although the gateway keys or forwards the request by it; nothing was "
        "forwarded. Remove it from Connection.",
        headers=_CLOSE,
    )


def request_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "request-body-too-large",
        "The request body is larger than the gateway takes",
        f"The gateway reads a request body whole before forwarding it, up to {limit} bytes; "
        "this one is larger, and nothing was forwarded. Send a smaller body.",
        extra={"limit": limit},
        headers=_CLOSE,
    )


def body_timeout(seconds: float, *, whole: bool = False, forwarded: bool = False) -> Problem:
    """`forwarded`: the body was streamed on as it came (`request_spool_bytes` 0), and the
    request and part of its body had gone upstream already."""
    if whole:
        title = "The request body did not arrive in time"
        what = f"The request body was not whole within {seconds:g} s"
    else:
        title = "The request body stopped arriving"
        what = f"No part of the request body arrived for {seconds:g} s"
    if forwarded:
        outcome = (
            "the request and its body so far went on to the upstream as they came, and its "
            "connection to the upstream was closed: the upstream got a request cut short, and "
            "may or may not have acted on it. The connection is closed. Send the body "
            "without pausing (with an Idempotency-Key to make retrying it safe)."
        )
    else:
        outcome = (
            "nothing was forwarded, and the connection is closed. Send the body without pausing."
        )
    return Problem(408, "request-body-timeout", title, f"{what}; {outcome}", headers=_CLOSE)


def header_timeout(seconds: float) -> Problem:
    return Problem(
        408,
        "header-timeout",
        "The request head did not arrive in time",
        f"The request line and headers did not all arrive within {seconds:g} s; nothing was "
        "forwarded and the connection is closed. Send the request's head at once.",
        headers=_CLOSE,
    )


def too_many_connections(limit: int) -> Problem:
    return Problem(
        503,
        "too-many-connections",
        "The gateway holds as many connections as it takes",
        f"The gateway already holds {limit} client connections (per worker); this one was "
        "closed before anything was read, and nothing was forwarded. Retry after Retry-After "
        "seconds, or reuse a connection.",
        retry_after=1,
        headers=_CLOSE,
    )


def storage_failed() -> Problem:
    return Problem(
        503,
        "gateway-storage-failed",
        "The gateway could not hold the request or its answer",
        "The gateway's temporary files failed (a full disk, or no file descriptors left) while "
        "it held this request's body or its answer, and nothing of an answer was sent. With "
        "an Idempotency-Key, retry with the same key after Retry-After seconds: a request that "
        "reached the upstream keeps its outcome (replayed, or reported as unknown), and one "
        "that did not runs then.",
        retry_after=1,
    )


def malformed_request() -> Problem:
    return Problem(
        400,
        "malformed-request",
        "The request is not valid HTTP/1.1",
        "The server could not parse the request (its line, a header, or the framing of its "
        "body, such as both Content-Length and Transfer-Encoding), and the connection is "
        "closed. Nothing was forwarded, unless a body past the request buffer was being "
        "streamed to the upstream (no request spool) when its framing broke. Fix the request "
        "and send it again.",
        headers=_CLOSE,
    )
