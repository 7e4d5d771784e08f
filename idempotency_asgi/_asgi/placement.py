"""A CORS middleware inside IdempotencyMiddleware, found when the middleware is made.

A CORS middleware answers each request for the origin that sent it. Inside the idempotency
middleware, its headers are part of the answer that is recorded: a replay asked for by origin B
carries the `Access-Control-Allow-Origin` stored for origin A's first request, and the browser
refuses it; and the middleware's own answers (401, 409, 422, 503) never pass through it, so they
carry no CORS headers at all, and the browser hides them from the page. FastAPI's tutorials add
`CORSMiddleware` first, and Starlette runs the middleware added last outermost: the mistake is
the natural order.

Found by what the middleware wraps: the `.app` of each middleware inside it in turn (the
attribute Starlette's middleware, and most others, keep the app they wrap in), and the
`user_middleware` of a Starlette or FastAPI application it wraps directly, whose middleware are
made only when it first runs. Mounted applications are not looked into.
"""

from __future__ import annotations

from collections.abc import Iterator

from starlette.middleware.cors import CORSMiddleware

#: How many wrapped apps are looked at, at most: far more than any real stack.
MAX_DEPTH = 100

ADDED_INSIDE = (
    "CORSMiddleware is inside IdempotencyMiddleware: it was added to the application before "
    "it (Starlette runs the middleware added last outermost), or listed after it in "
    "middleware=[...]."
)
WRAPPED_INSIDE = (
    "CORSMiddleware is inside IdempotencyMiddleware: it is in the middleware of the "
    "application that IdempotencyMiddleware wraps."
)
WHY = (
    " Inside, a replay would carry the Access-Control-Allow-Origin recorded for the first "
    "caller's origin, and IdempotencyMiddleware's own answers (401, 409, 422, 503) no CORS "
    "headers at all: browsers would refuse both. Put CORSMiddleware outside: "
    "app.add_middleware(CORSMiddleware, ...) after app.add_middleware(IdempotencyMiddleware, "
    "...), or before it in middleware=[...], or CORSMiddleware(IdempotencyMiddleware(app, ...), "
    "...) when wrapping."
)


def cors_inside(app: object) -> str | None:
    """What is wrong, and how to put it right, when a CORS middleware is inside `app` (what
    IdempotencyMiddleware wraps); None when there is none."""
    for found, wrapped in _inside(app):
        if _is_cors(found):
            return (WRAPPED_INSIDE if wrapped else ADDED_INSIDE) + WHY
    return None


def _inside(app: object) -> Iterator[tuple[object, bool]]:
    """`app` and everything it wraps, each with whether it is a middleware a wrapped
    application will make (a class, from its `user_middleware`)."""
    seen: set[int] = set()
    current: object = app
    for _ in range(MAX_DEPTH):
        if current is None or id(current) in seen:
            return
        seen.add(id(current))
        yield current, False
        for entry in getattr(current, "user_middleware", None) or ():
            yield getattr(entry, "cls", None), True
        current = getattr(current, "app", None)


def _is_cors(candidate: object) -> bool:
    """Starlette's CORSMiddleware (FastAPI's is the same class), a subclass, or a class of
    that name (a copy of it), made or to be made."""
    kind = candidate if isinstance(candidate, type) else type(candidate)
    return issubclass(kind, CORSMiddleware) or kind.__name__ == "CORSMiddleware"
