"""How the gateway reads an upstream answer's head (answers.py): its framing, and what makes
it one that cannot be passed on. The wire tests (test_gateway_framing.py,
test_gateway_answer_checks.py) show each on a real connection."""

from __future__ import annotations

import pytest

from idempotency_asgi.gateway.answers import parse_head
from idempotency_asgi.gateway.upstream import MalformedAnswer


def head(*lines: bytes, request: bytes = b"POST"):
    return parse_head(b"\r\n".join(lines), head_request=request == b"HEAD")


@pytest.mark.parametrize(
    ("lines", "framing", "length", "keep_alive"),
    [
        ((b"HTTP/1.1 200 OK", b"Content-Length: 5"), "length", 5, True),
        ((b"HTTP/1.1 200 OK", b"Content-Length: 5, 5", b"content-length: 5"), "length", 5, True),
        ((b"HTTP/1.1 200 OK", b"Transfer-Encoding: Chunked"), "chunked", None, True),
        ((b"HTTP/1.1 200 OK",), "close", None, False),
        ((b"HTTP/1.1 204 No Content",), "none", None, True),
        ((b"HTTP/1.1 304 Not Modified", b"Content-Length: 0"), "none", None, True),
        (
            (b"HTTP/1.1 200 OK", b"Content-Length: 5", b"Connection: keep-alive, Close"),
            "length",
            5,
            False,
        ),
        ((b"HTTP/1.0 200 OK", b"Content-Length: 5"), "length", 5, False),
        ((b"HTTP/1.1 200", b"Content-Length: 0"), "length", 0, True),
    ],
)
def test_how_a_body_is_framed(lines, framing, length, keep_alive):
    parsed = head(*lines)
    assert parsed.invalid is None
    assert (parsed.framing, parsed.length, parsed.keep_alive) == (framing, length, keep_alive)


def test_an_answer_to_head_has_no_body_whatever_its_length_says():
    parsed = head(b"HTTP/1.1 200 OK", b"Content-Length: 5000", request=b"HEAD")
    assert (parsed.framing, parsed.invalid, parsed.phantom_length) == ("none", None, False)


@pytest.mark.parametrize("status", [204, 304])
def test_a_bodiless_status_declaring_a_length_is_marked(status):
    parsed = head(b"HTTP/1.1 %d X" % status, b"Content-Length: 5")
    assert (parsed.framing, parsed.phantom_length, parsed.invalid) == ("none", True, None)


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        ((b"HTTP/1.1 200 OK", b"Content-Length: 2", b"Transfer-Encoding: chunked"), "both"),
        ((b"HTTP/1.1 200 OK", b"Transfer-Encoding: gzip, chunked"), "transfer coding"),
        ((b"HTTP/1.1 200 OK", b"Transfer-Encoding: gzip"), "transfer coding"),
        ((b"HTTP/1.0 200 OK", b"Transfer-Encoding: chunked"), "HTTP/1.0"),
        ((b"HTTP/1.1 200 OK", b"Content-Length: 5, 6"), "not one number"),
        ((b"HTTP/1.1 200 OK", b"Content-Length: 5", b"Content-Length: 6"), "not one number"),
        ((b"HTTP/1.1 200 OK", b"Content-Length: +5"), "not one number"),
        ((b"HTTP/1.1 200 OK", b"X-A: a\x01b"), "control character"),
        ((b"HTTP/1.1 200 OK", b"X-A: a\x7fb"), "control character"),
        ((b"HTTP/1.1 200 OK", b"X-A: a\rb"), "control character"),
        ((b"HTTP/1.1 200 OK", b"X-A: a\x00b"), "control character"),
        ((b"HTTP/1.1 200 OK", b"X A: b"), "not a field"),
        ((b"HTTP/1.1 200 OK", b"X-A : b"), "not a field"),
        ((b"HTTP/1.1 200 OK", b"no colon"), "not a field"),
        ((b"HTTP/1.1 200 OK", b"X-A: one", b" two"), "folded"),
        ((b"HTTP/1.1 600 Beyond", b"Content-Length: 0"), "status 600"),
        ((b"HTTP/1.1 101 Switching", b"Upgrade: x"), "status 101"),
    ],
)
def test_what_cannot_be_passed_on(lines, reason):
    parsed = head(*lines)
    assert parsed.invalid is not None and reason in parsed.invalid
    assert parsed.keep_alive is False  # nothing more is read on that connection


def test_a_value_may_hold_tabs_and_bytes_past_ascii():
    parsed = head(b"HTTP/1.1 200 OK", b"X-A: a\tb \xe9", b"Content-Length: 0")
    assert parsed.invalid is None
    assert parsed.headers[0] == (b"X-A", b"a\tb \xe9")


@pytest.mark.parametrize(
    "first", [b"HTTP/2 200 OK", b"HTTP/1.1 20 OK", b"ICY 200 OK", b"", b"HTTP/1.1 2000 OK"]
)
def test_a_head_without_a_status_line_is_not_http(first):
    with pytest.raises(MalformedAnswer):
        head(first, b"Content-Length: 0")


def test_an_interim_answer_is_one():
    assert head(b"HTTP/1.1 100 Continue").interim
    assert head(b"HTTP/1.1 103 Early Hints", b"Link: </a>; rel=preload").interim
    assert not head(b"HTTP/1.1 101 Switching Protocols").interim
