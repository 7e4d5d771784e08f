"""The chunked decoder (chunks.py) against the definition (RFC 9112, section 7.1), read one
chunk at a time: any body, any chunk sizes, extensions and line ends, split across reads
anywhere, decodes to the same data and ends at the same byte; and its CPU grows linearly
with the number of chunks."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotency_asgi.gateway import chunks as chunks_module
from idempotency_asgi.gateway import connection
from idempotency_asgi.gateway.chunks import ChunkedDecoder
from idempotency_asgi.gateway.upstream import MalformedAnswer

CHUNK = st.tuples(
    st.binary(min_size=1, max_size=40),
    st.sampled_from([b"", b";ext=1", b" ", b";a"]),  # extensions, padding
    st.sampled_from([b"\r\n", b"\n"]),  # the size line's end
    st.sampled_from([b"\r\n", b"\n"]),  # the data's end
    st.booleans(),  # upper-case hex, leading zeros
)


def encode(chunks) -> bytes:
    out = b""
    for data, extension, line_end, data_end, odd in chunks:
        size = (b"%04X" if odd else b"%x") % len(data)
        out += size + extension + line_end + data + data_end
    return out + b"0\r\n\r\n"


def decode_all(body: bytes, cuts: list[int]) -> tuple[bytes, bytes]:
    """Fed in the reads `cuts` makes of `body`: the data, and what followed the last chunk."""
    decoder = ChunkedDecoder()
    reads = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    data, left = b"", b""
    for read in reads:
        if decoder.ended:
            left += read
            continue
        part, left = decoder.feed(left + read)
        data += part
        while decoder.paused:  # it stopped after ONE_BY_ONE chunks: the rest, at once
            part, left = decoder.feed(left)
            data += part
    assert decoder.ended
    return data, left


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(CHUNK, max_size=40),
    plain=st.lists(st.binary(min_size=1, max_size=30), max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
)
def test_any_body_split_anywhere_decodes_to_its_data(chunks, plain, cuts):
    # Plain chunks (decoded all at once when a read holds enough), then odd ones.
    shaped = [(d, b"", b"\r\n", b"\r\n", False) for d in plain] + chunks
    body = encode(shaped)
    expected = b"".join(chunk[0] for chunk in shaped)
    data, after = decode_all(body + b"NEXT", sorted(min(c, len(body)) for c in cuts))
    assert data == expected
    assert after.startswith(b"\r\n") and after.endswith(b"NEXT")  # trailers' end, then more


class Reads:
    """A connected stream that hands out these reads, then nothing more."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._reads.pop(0) if self._reads else b""

    def get_extra_info(self, name: str) -> None:
        return None


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(CHUNK, max_size=40),
    plain=st.lists(st.binary(min_size=1, max_size=30), max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
    one_by_one=st.sampled_from([1, 3, chunks_module.ONE_BY_ONE]),
)
def test_an_answer_decoded_in_bounded_feeds_reads_the_same(chunks, plain, cuts, one_by_one):
    # The connection feeds the decoder what it read until it is neither paused (it stops
    # after ONE_BY_ONE chunks decoded one by one; a few here, so that short bodies pause
    # too) nor short of a line: the same data, the trailers read, and what came after the
    # answer left for the connection.
    shaped = chunks + [(d, b"", b"\r\n", b"\r\n", False) for d in plain] + chunks
    body = encode(shaped)[:-2] + b"X-Trailer: t\r\n\r\nNEXT"
    expected = b"".join(chunk[0] for chunk in shaped)
    ends = sorted({min(c, len(body)) for c in cuts} - {0, len(body)})
    reads = [body[a:b] for a, b in zip([0, *ends], [*ends, len(body)], strict=True)]

    async def decoded() -> tuple[bytes, bytes]:
        stream = Reads(reads)
        upstream = connection.UpstreamConnection(stream, keepalive_expiry=5)  # type: ignore[arg-type]
        data = b"".join([part async for part in upstream._by_chunks(None)])
        # What came after the answer: what the connection read of it, then what it did not.
        return data, upstream._buffer + b"".join(stream._reads)

    with mock.patch.object(chunks_module, "ONE_BY_ONE", one_by_one):
        data, after = asyncio.run(decoded())
    assert data == expected
    assert after == b"NEXT"


def test_a_feed_decodes_a_bounded_number_of_chunks_one_by_one():
    # One-byte chunks with bare LFs (no plain shape to check all at once): a 256 KiB read
    # is decoded ONE_BY_ONE chunks a feed, each feed's part going on before the next.
    read = (b"1\nx\n" * 65_536)[: 256 * 1024]
    decoder = ChunkedDecoder()
    part, left = decoder.feed(read)
    assert decoder.paused and part == b"x" * chunks_module.ONE_BY_ONE
    feeds, data = 1, part
    while decoder.paused:
        part, left = decoder.feed(left)
        feeds, data = feeds + 1, data + part
    assert data == b"x" * (len(read) // 4) and left == b""
    assert feeds == -(-len(read) // 4 // chunks_module.ONE_BY_ONE)
    # Plain chunks are still a read at once.
    plain = (b"50\r\n" + b"r" * 80 + b"\r\n") * 3000
    decoder = ChunkedDecoder()
    part, left = decoder.feed(plain)
    assert not decoder.paused and part == b"r" * 240_000 and left == b""


@pytest.mark.parametrize(
    "body",
    [b"5\r\nhello!\r\n0\r\n\r\n", b"zz\r\nhello\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", b"-5\r\n"],
)
def test_a_chunk_that_is_not_one_is_refused(body):
    with pytest.raises(MalformedAnswer):
        decode_all(body, [])


def test_the_cost_grows_linearly_with_the_chunks():
    """10 MB in 80-byte chunks, fed as 256 KiB reads, against 1 MB: about ten times the time
    (the decoder before copied its buffer per chunk: 2.0 s for 10 MB in the gateway)."""

    def cost(size: int, chunk: int) -> float:
        body = (b"%x\r\n" % chunk + b"r" * chunk + b"\r\n") * (size // chunk) + b"0\r\n\r\n"
        reads = [body[i : i + 256 * 1024] for i in range(0, len(body), 256 * 1024)]
        best = float("inf")
        for _ in range(3):
            decoder, left = ChunkedDecoder(), b""
            started = time.process_time()
            for read in reads:
                _, left = decoder.feed(left + read if left else read)
            best = min(best, time.process_time() - started)
        return best

    small, large = cost(1_000_000, 80), cost(10_000_000, 80)
    assert large < 0.5, large
    assert large < 15 * small + 0.05, (small, large)  # ten times the chunks: about ten times
