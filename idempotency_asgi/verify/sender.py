"""Sending one probe request over HTTP and keeping what came back, with its timing."""

from __future__ import annotations

import time

import httpx

from .report import Exchange
from .target import Target, field_value


class VerifyError(Exception):
    """verify could not judge anything: the service is unreachable, or the route refuses a
    fresh request (the credential or the body is wrong). The message says which."""


class Sender:
    def __init__(self, client: httpx.AsyncClient, target: Target) -> None:
        self._client = client
        self._target = target
        self._epoch = time.monotonic()
        self._reached = False

    async def send(
        self,
        label: str,
        key: str | None,
        body: bytes,
        *,
        other: bool = False,
        slow: bool = False,
    ) -> Exchange:
        """One request; a transport error is kept in the exchange, except on the very first
        request of a run, where it means the service cannot be reached at all."""
        target = self._target
        # As bytes: httpx would encode text as ASCII, and fail on a value that is not. Names
        # are tokens (checked with the values when the Target was made), so ASCII.
        headers = [
            (name.encode("ascii"), field_value(value))
            for name, value in target.request_headers(key, other=other, slow=slow)
        ]
        started = time.monotonic()
        try:
            response = await self._client.request(
                target.method, target.url, headers=headers, content=body
            )
        except httpx.RequestError as exc:  # no answer: refused, reset, timed out, undecodable
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not self._reached:
                raise VerifyError(f"cannot reach {target.url}: {reason}") from exc
            return Exchange(
                label=label,
                key=key,
                started=started - self._epoch,
                elapsed=time.monotonic() - started,
                error=reason,
            )
        self._reached = True
        return Exchange(
            label=label,
            key=key,
            started=started - self._epoch,
            elapsed=time.monotonic() - started,
            status=response.status_code,
            headers=tuple(response.headers.multi_items()),
            body=response.content,
        )
