"""Run the suite with the store's batching forced on, or off: IDEMPOTENCY_TEST_BATCHING.

- unset: as users get it (on: statements coalesce under load only);
- `forced`: every claim, completion, release and renewal goes out as the batched statement
  (arrays), even for one row, and a statement that would go out while none of its kind is
  in flight first waits HOLD_SECONDS for company, so that concurrent requests nearly always
  share their statements, even at the suite's load;
- `off`: every store is made with `batch=False`, one statement per request.

`install()` applies it to every PostgresStore made afterwards in this process; the test
apps served by uvicorn (tests/apps.py, tests/fuzz_app.py) call it too, and inherit the
variable.
"""

from __future__ import annotations

import os
from typing import Any

from idempotency_asgi import PostgresStore
from idempotency_asgi._postgres.batching import Batcher

VARIABLE = "IDEMPOTENCY_TEST_BATCHING"


#: How long a lone statement waits for another to share it, when forced.
HOLD_SECONDS = 0.02

_installed = False

#: Statements sent by the batchers of this process, and how many carried two rows or more.
sent = {"statements": 0, "shared": 0}


def mode() -> str:
    return os.environ.get(VARIABLE, "")


def install() -> None:
    global _installed
    if _installed or mode() not in ("forced", "off"):
        return
    _installed = True
    original = PostgresStore.__init__

    def made(self: PostgresStore, *args: Any, **kwargs: Any) -> None:
        if mode() == "off":
            kwargs["batch"] = False
        original(self, *args, **kwargs)
        if mode() == "forced":
            self._db.arrays_always = True
            for batcher in self._batchers().values():
                batcher._hold = HOLD_SECONDS

    PostgresStore.__init__ = made  # type: ignore[method-assign]
    send = Batcher._send

    async def counted(self: Batcher[Any, Any], batch: list[Any]) -> None:
        sent["statements"] += 1
        sent["shared"] += len(batch) > 1
        await send(self, batch)

    Batcher._send = counted  # type: ignore[method-assign]
