"""What the upstream receives: the request target and the framing headers. The target is the
client's, byte for byte under the upstream's prefix (only bytes that cannot go on the wire are
percent-encoded), over examples and generated inputs; the framing headers are held to what
httpx's Request added to the same input."""

from __future__ import annotations

import h11
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotency_asgi.gateway.headers import framed
from idempotency_asgi.gateway.target import UpstreamURL


def sendable(target: bytes) -> bool:
    """Whether h11 (under httpcore, the gateway's client) writes it as a request target."""
    try:
        h11.Request(method="GET", target=target, headers=[("Host", "up")])
    except h11.LocalProtocolError:
        return False
    return True


@pytest.mark.parametrize(
    ("upstream", "raw_path", "query", "expected"),
    [
        ("http://127.0.0.1:9000", b"/orders", b"", b"/orders"),
        ("http://127.0.0.1:9000/", b"/orders", b"a=1&b=%20", b"/orders?a=1&b=%20"),
        ("http://up:9000/api/", b"/orders/7", b"", b"/api/orders/7"),
        ("https://up/api", b"/a%2Fb", b"q", b"/api/a%2Fb?q"),
        ("http://up", b"/caf\xc3\xa9", b"x=\xff", b"/caf%C3%A9?x=%FF"),
        ("http://up", b"/v1.2/items.json", b"v=1.2", b"/v1.2/items.json?v=1.2"),
        ("http://up", b"/a b", b"", b"/a%20b"),  # a space cannot go on the wire as it is
        ("http://up", b"/a\tb\x7f", b"", b"/a%09b%7F"),
        ("http://up", b'/a"b<c>{d}`e|f^g\\h', b"", b'/a"b<c>{d}`e|f^g\\h'),
        ("http://up", b"/%zz/%", b"q=%ZZ&r=%", b"/%zz/%?q=%ZZ&r=%"),
        ("http://up", b"/x", b'q={x}&u="&v=<>&w=\\', b'/x?q={x}&u="&v=<>&w=\\'),
        ("http://up/api", b"//double//slash/", b"", b"/api//double//slash/"),
        ("http://up", b"/a/./b", b"", b"/a/./b"),  # never normalized (the gateway refuses it)
    ],
)
def test_the_target_is_passed_on_as_received_under_the_upstreams_prefix(
    upstream, raw_path, query, expected
):
    scope = {"raw_path": raw_path, "path": "unused", "query_string": query}
    assert UpstreamURL(upstream).target(scope) == expected
    assert sendable(expected)


def test_without_a_raw_path_the_path_is_sent_utf_8_encoded():
    scope = {"path": "/café", "query_string": b""}
    assert UpstreamURL("http://up").target(scope) == b"/caf%C3%A9"


@pytest.mark.parametrize("raw_path", [b"*", b"http://other/x", b"x"])
def test_a_target_that_is_not_a_path_is_refused(raw_path):
    with pytest.raises(ValueError, match="not a path"):
        UpstreamURL("http://up/api").target({"raw_path": raw_path, "query_string": b""})


@pytest.mark.parametrize(("raw_path", "query"), [(b"/x#frag", b""), (b"/x", b"a=1#frag")])
def test_a_target_with_a_fragment_is_refused(raw_path, query):
    """h11 lets a fragment through, in the path or (after a `?`) in the query."""
    with pytest.raises(ValueError, match="fragment"):
        UpstreamURL("http://up").target({"raw_path": raw_path, "query_string": query})


def escaped(data: bytes) -> bytes:
    """Byte by byte: visible ASCII as it is, anything else percent-encoded."""
    return b"".join(bytes([c]) if 0x21 <= c <= 0x7E else b"%%%02X" % c for c in data)


@settings(max_examples=400, deadline=None)
@given(
    upstream=st.sampled_from(["http://127.0.0.1:9000", "http://up/api/", "https://up:8443/a/b"]),
    path=st.binary(max_size=40),
    query=st.binary(max_size=20),
)
def test_any_target_is_sent_byte_for_byte(upstream, path, query):
    raw_path = b"/" + path.replace(b"#", b"")
    query = query.replace(b"#", b"")  # a fragment is refused (above)
    scope = {"raw_path": raw_path, "path": "unused", "query_string": query}
    prefix = httpx.URL(upstream).raw_path.rstrip(b"/")
    expected = prefix + escaped(raw_path) + (b"?" + escaped(query) if query else b"")
    target = UpstreamURL(upstream).target(scope)
    assert target == expected
    assert sendable(target)


# -- framing --------------------------------------------------------------------------------


async def streamed_body():
    yield b"chunk"


def as_httpx_framed(headers, method: str, body: bytes | None) -> list[tuple[bytes, bytes]]:
    content = streamed_body() if body is None else body
    request = httpx.Request(method, "http://up:9000/x", headers=headers, content=content)
    return request.headers.raw


HEADER = st.tuples(
    st.sampled_from(
        [
            *(b"host", b"Host", b"content-length", b"Content-Length", b"transfer-encoding"),
            *(b"TRANSFER-ENCODING", b"x-a", b"user-agent", b"accept"),
        ]
    ),
    st.sampled_from([b"1", b"7", b"chunked", b"v"]),
)


@settings(max_examples=400, deadline=None)
@given(
    headers=st.lists(HEADER, max_size=6),
    method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
    body=st.sampled_from([None, b"", b"abc", b"x" * 1000]),
)
def test_framing_headers_are_what_httpx_added(headers, method, body):
    length = None if body is None else len(body)
    assert framed(list(headers), method=method, length=length, host=b"up:9000") == (
        as_httpx_framed(headers, method, body)
    )


def test_framing_examples():
    sent = [(b"user-agent", b"ua")]
    assert framed(list(sent), method="GET", length=0, host=b"up") == [(b"Host", b"up"), *sent]
    assert framed(list(sent), method="POST", length=0, host=b"up") == [
        (b"Host", b"up"),
        (b"Content-Length", b"0"),
        *sent,
    ]
    assert framed(list(sent), method="POST", length=2, host=b"up") == [
        (b"Host", b"up"),
        *sent,
        (b"Content-Length", b"2"),
    ]
    assert framed(list(sent), method="PUT", length=None, host=b"up") == [
        (b"Host", b"up"),
        *sent,
        (b"Transfer-Encoding", b"chunked"),
    ]
    # Methods are case-sensitive: a "post" is not a POST, and gets nothing a POST would.
    assert framed(list(sent), method="post", length=0, host=b"up") == [(b"Host", b"up"), *sent]
    preserved = [(b"host", b"client.example"), (b"content-length", b"2")]
    assert framed(list(preserved), method="POST", length=2, host=b"up") == preserved


# -- any httpx transport ----------------------------------------------------------------------


async def test_a_transport_of_ones_own_gets_the_same_request():
    from idempotency_asgi.gateway import build_gateway

    seen: list[httpx.Request] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        await request.aread()
        return httpx.Response(201, headers=[(b"X-Up", b"1")], content=b"made")

    app = build_gateway(
        "http://up:9000/api",
        store="postgresql://127.0.0.1:1/none",
        tenant=lambda scope: "t",
        apply_schema=False,
        transport=httpx.MockTransport(upstream),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("10.0.0.9", 1234)), base_url="http://g"
    ) as http:
        response = await http.put("/orders/7?q=1", content=b"{}", headers={"x-a": "b"})
    assert (response.status_code, response.content) == (201, b"made")
    assert response.headers["x-up"] == "1"
    (request,) = seen
    assert request.method == "PUT"
    assert request.url.raw_path == b"/api/orders/7?q=1"
    assert request.content == b"{}"
    # As the gateway's own pool frames them: the upstream's Host in front, the client's
    # end-to-end headers in order (Connection dropped), then the X-Forwarded-* ones.
    assert request.headers.raw == [
        (b"Host", b"up:9000"),
        (b"accept", b"*/*"),
        (b"accept-encoding", b"gzip, deflate"),
        (b"user-agent", f"python-httpx/{httpx.__version__}".encode()),
        (b"x-a", b"b"),
        (b"content-length", b"2"),
        (b"x-forwarded-for", b"10.0.0.9"),
        (b"x-forwarded-proto", b"http"),
        (b"x-forwarded-host", b"g"),
    ]


@pytest.mark.parametrize(
    ("spool", "framing"),
    [(None, (b"content-length", b"100")), (0, (b"transfer-encoding", b"chunked"))],
    ids=["read-whole", "streamed"],
)
async def test_a_body_past_the_memory_buffer_is_read_whole_unless_streaming(spool, framing):
    """By default a body is read whole (past `request_buffer_bytes`, into a temporary file)
    and forwarded with its length; with `request_spool_bytes=0` what was read ahead goes
    first and the rest as it arrives, chunked."""
    from idempotency_asgi.gateway import build_gateway

    seen: list[tuple[list[tuple[bytes, bytes]], bytes]] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(([(n.lower(), v) for n, v in request.headers.raw], await request.aread()))
        return httpx.Response(200, content=b"ok")

    options = {} if spool is None else {"request_spool_bytes": spool}
    app = build_gateway(
        "http://up:9000",
        store="postgresql://127.0.0.1:1/none",
        tenant=lambda scope: "t",
        apply_schema=False,
        transport=httpx.MockTransport(upstream),
        request_buffer_bytes=8,
        **options,
    )

    async def body():
        for _ in range(10):
            yield b"0123456789"

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://g"
    ) as http:
        response = await http.put("/upload", content=body())
    assert response.status_code == 200
    ((sent, content),) = seen
    assert content == b"0123456789" * 10
    assert framing in sent
