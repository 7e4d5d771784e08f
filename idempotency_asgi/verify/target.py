"""What `verify` probes, and how: the route, its headers, the body template, the options."""

from __future__ import annotations

import json
import re
import secrets
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

PLACEHOLDER = "{unique}"
"""Replaced in the body template by a fresh value for every probe, for routes that refuse a
repeated value (an order reference, an email): `v` and 16 hex digits."""

DEFAULT_MARKER = ("Idempotent-Replayed", "true")
"""idempotency-asgi's replay marker. The draft defines none; other implementations may use
another header, or none (`replay_marker=None`)."""

Headers = tuple[tuple[str, str], ...]

#: RFC 9110 field-name: a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: RFC 9110 field-value: no control character but HTAB.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: Headers verify sets on every request itself: one given as well would be sent twice.
_OWN = {
    "idempotency-key": "every probe sends a fresh key of its own",
    "content-length": "it frames each body itself",
    "transfer-encoding": "it frames each body itself",
}


def parse_header(text: str) -> tuple[str, str]:
    """`Name: value` -> ("Name", "value"); ValueError when it is not a header that can be
    sent (see `check_header`)."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name:
        raise ValueError(f"{text!r} is not a header: write it as 'Name: value'")
    check_header(name, value)
    return name, value


def check_header(name: str, value: str) -> None:
    """ValueError unless the header can go on the wire as it is: the one place that decides,
    for the command line and for `Target` alike, so that no probe fails on it later."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a header name (RFC 9110 token: letters, digits, !#$%&'*+-.^_`|~)"
        )
    if _CONTROL.search(value):
        raise ValueError(f"{name}: the value holds a control character")
    if value != value.strip(" \t"):
        raise ValueError(f"{name}: the value starts or ends with whitespace")
    try:
        field_value(value)
    except UnicodeEncodeError:
        raise ValueError(f"{name}: the value is not text (a lone surrogate)") from None


def check_sent_header(name: str, value: str) -> None:
    """`check_header`, and not one of the headers verify sets itself."""
    check_header(name, value)
    why = _OWN.get(name.lower())
    if why is not None:
        raise ValueError(f"{name} is verify's own: {why}")


def field_value(value: str) -> bytes:
    """The bytes sent for a header value: the text as UTF-8, as curl sends what was typed.
    Bytes that were not UTF-8 on the command line reach Python as surrogate escapes and go
    out as they came."""
    return value.encode("utf-8", "surrogateescape")


def new_key() -> str:
    return f"verify-{uuid.uuid4()}"


def new_unique() -> str:
    return "v" + secrets.token_hex(8)


@dataclass(frozen=True)
class Target:
    """A route to verify. `body` is a template: every `{unique}` in it becomes a fresh value
    per probe. `other_headers`, when given, are a second credential's (the probe of key
    independence runs only then); `slow_headers` go on the requests meant to overlap an
    in-flight one (a header that slows the route, such as the example's X-Fault-Delay-Ms)."""

    url: str
    body: str = ""
    method: str = "POST"
    headers: Headers = ()
    other_headers: Headers | None = None
    slow_headers: Headers = ()
    changed_body: str | None = None
    concurrency: int = 10
    key_required: bool = True
    replay_marker: tuple[str, str] | None = DEFAULT_MARKER
    quote_key: bool = False
    timeout: float = 30.0
    #: Judge by the draft alone: idempotency-asgi's own properties are still run and
    #: reported, but do not decide whether the service passed.
    draft_only: bool = False

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{self.url!r} is not an http:// or https:// URL")
        try:
            parts.port  # noqa: B018 (a bad port raises here)
        except ValueError as exc:
            raise ValueError(f"{self.url!r}: {exc}") from None
        if self.concurrency < 2:
            raise ValueError("concurrency must be at least 2 (one request and a duplicate)")
        if not self.timeout > 0:
            raise ValueError("timeout must be positive")
        sent = (
            ("headers", self.headers),
            ("other_headers", self.other_headers or ()),
            ("slow_headers", self.slow_headers),
        )
        for field, headers in sent:
            for name, value in headers:
                try:
                    check_sent_header(name, value)
                except ValueError as exc:
                    raise ValueError(f"{field}: {exc}") from None
        if self.replay_marker is not None:
            try:
                check_header(*self.replay_marker)
            except ValueError as exc:
                raise ValueError(f"replay_marker: {exc}") from None
        object.__setattr__(self, "method", self.method.upper())

    @cached_property
    def json_body(self) -> bool:
        """Whether the body is JSON once rendered (it then gets a JSON Content-Type)."""
        try:
            json.loads(self.render(new_unique()))
        except ValueError:
            return False
        return True

    def render(self, unique: str, template: str | None = None) -> bytes:
        return (self.body if template is None else template).replace(PLACEHOLDER, unique).encode()

    def changed(self, unique: str) -> tuple[bytes, str] | None:
        """A request body that differs from `render(unique)` in content, and how; None when
        there is no way to make one that the route would still accept."""
        if self.changed_body is not None:
            return self.render(unique, self.changed_body), "the body given as the changed body"
        if PLACEHOLDER in self.body:
            other = new_unique()
            return self.render(other), f"{PLACEHOLDER} = {other} instead of {unique}"
        try:
            document: Any = json.loads(self.render(unique))
        except ValueError:
            return None
        if isinstance(document, dict):
            for name, value in document.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    changed = {**document, name: value + 1}
                    return json.dumps(changed).encode(), f'"{name}": {value} -> {value + 1}'
        return None

    def request_headers(
        self, key: str | None, *, other: bool = False, slow: bool = False
    ) -> Headers:
        base = self.other_headers if other and self.other_headers is not None else self.headers
        result = list(base)
        if self.json_body and not any(name.lower() == "content-type" for name, _ in result):
            result.append(("Content-Type", "application/json"))
        if slow:
            result += self.slow_headers
        if key is not None:
            result.append(("Idempotency-Key", f'"{key}"' if self.quote_key else key))
        return tuple(result)

    def describe(self) -> dict[str, Any]:
        """The options, for the report (header values are not repeated: they hold secrets)."""
        return {
            "method": self.method,
            "url": self.url,
            "header_names": [name for name, _ in self.headers],
            "other_credential": self.other_headers is not None,
            "slow_header_names": [name for name, _ in self.slow_headers],
            "concurrency": self.concurrency,
            "key_required": self.key_required,
            "replay_marker": None if self.replay_marker is None else ": ".join(self.replay_marker),
            "quote_key": self.quote_key,
            "draft_only": self.draft_only,
        }
