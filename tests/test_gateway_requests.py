"""What the upstream receives: the request target and the framing headers. The gateway builds
them itself now instead of through httpx's URL and Request objects; these tests hold it to
what httpx made of the same input, over examples and generated inputs."""

from __future__ import annotations

from urllib.parse import quote_from_bytes

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotency_asgi.gateway.headers import framed
from idempotency_asgi.gateway.target import UpstreamURL


@pytest.mark.parametrize(
    ("upstream", "raw_path", "query", "expected"),
    [
        ("http://127.0.0.1:9000", b"/orders", b"", b"/orders"),
        ("http://127.0.0.1:9000/", b"/orders", b"a=1&b=%20", b"/orders?a=1&b=%20"),
        ("http://up:9000/api/", b"/orders/7", b"", b"/api/orders/7"),
        ("https://up/api", b"/a%2Fb", b"q", b"/api/a%2Fb?q"),
        ("http://up", b"/caf\xc3\xa9", b"x=\xff", b"/caf%C3%A9?x=%FF"),
        ("http://up", b"/v1.2/items.json", b"v=1.2", b"/v1.2/items.json?v=1.2"),
        ("http://up", b"/a b", b"", b"/a%20b"),  # escaped as httpx escapes it
        ("http://up", b"/a/./b", b"", b"/a/b"),  # dot segments removed as httpx does
    ],
)
def test_the_target_is_passed_on_as_received_under_the_upstreams_prefix(
    upstream, raw_path, query, expected
):
    scope = {"raw_path": raw_path, "path": "unused", "query_string": query}
    url = UpstreamURL(upstream)
    assert url.target(scope) == expected
    origin = url.origin
    sent = httpx.URL(f"{origin.scheme.decode()}://{url.netloc.decode()}{expected.decode()}")
    assert sent.raw_path == expected  # and httpx sends it as it is


def test_without_a_raw_path_the_path_is_sent_utf_8_encoded():
    scope = {"path": "/café", "query_string": b""}
    assert UpstreamURL("http://up").target(scope) == b"/caf%C3%A9"


def as_httpx_made_it(upstream: str, raw_path: bytes, query: bytes) -> bytes:
    """What the gateway sent before: the whole URL as a string, parsed by httpx."""
    url = httpx.URL(upstream)
    base = str(url.copy_with(raw_path=b"")).rstrip("/")
    prefix = url.raw_path.rstrip(b"/").decode("ascii")
    target = raw_path + b"?" + query if query else raw_path
    if not target.isascii():
        target = quote_from_bytes(target, safe=bytes(range(0x21, 0x7F))).encode("ascii")
    return httpx.URL(base + prefix + target.decode("ascii")).raw_path


# Every printable ASCII character, dots and slashes often (dot segments), a few bytes beyond.
TARGET_BYTES = st.sampled_from(
    [bytes([c]) for c in range(0x20, 0x7F)] + [b".", b"/", b"./", b"../", b"%2", b"\xc3\xa9"]
)


@settings(max_examples=400, deadline=None)
@given(
    upstream=st.sampled_from(["http://127.0.0.1:9000", "http://up/api/", "https://up:8443/a/b"]),
    path=st.lists(TARGET_BYTES, max_size=12).map(b"".join),
    query=st.lists(TARGET_BYTES, max_size=8).map(b"".join),
)
def test_any_target_is_sent_as_httpx_would_have_sent_it(upstream, path, query):
    raw_path = b"/" + path
    scope = {"raw_path": raw_path, "path": "unused", "query_string": query}
    try:
        expected = as_httpx_made_it(upstream, raw_path, query)
    except httpx.InvalidURL as refused:
        with pytest.raises(httpx.InvalidURL) as raised:
            UpstreamURL(upstream).target(scope)
        assert str(raised.value) == str(refused)
    else:
        assert UpstreamURL(upstream).target(scope) == expected


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
    assert framed(list(headers), method=method, body=body, host=b"up:9000") == (
        as_httpx_framed(headers, method, body)
    )


def test_framing_examples():
    sent = [(b"user-agent", b"ua")]
    assert framed(list(sent), method="GET", body=b"", host=b"up") == [(b"Host", b"up"), *sent]
    assert framed(list(sent), method="POST", body=b"", host=b"up") == [
        (b"Host", b"up"),
        (b"Content-Length", b"0"),
        *sent,
    ]
    assert framed(list(sent), method="POST", body=b"{}", host=b"up") == [
        (b"Host", b"up"),
        *sent,
        (b"Content-Length", b"2"),
    ]
    assert framed(list(sent), method="PUT", body=None, host=b"up") == [
        (b"Host", b"up"),
        *sent,
        (b"Transfer-Encoding", b"chunked"),
    ]
    preserved = [(b"host", b"client.example"), (b"content-length", b"2")]
    assert framed(list(preserved), method="POST", body=b"{}", host=b"up") == preserved


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
