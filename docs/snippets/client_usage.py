import os

import httpx

from idempotency_asgi.client import AsyncIdempotentTransport, replayed

PAYMENTS_URL = os.environ.get("PAYMENTS_URL", "http://127.0.0.1:8000")


def payments_client(sending: httpx.AsyncBaseTransport | None = None):
    transport = AsyncIdempotentTransport(sending, max_elapsed=30.0)  # (1)!
    return httpx.AsyncClient(
        transport=transport,
        base_url=PAYMENTS_URL,
        headers={"Authorization": "Bearer sk_test_acme"},
        timeout=10.0,  # (2)!
    )


async def pay(http: httpx.AsyncClient, order: str, amount: int) -> dict[str, object]:
    answer = await http.post(
        "/payments",
        json={"amount": amount, "currency": "EUR"},
        headers={"Idempotency-Key": f"order-{order}"},  # (3)!
    )
    answer.raise_for_status()  # (4)!
    if replayed(answer):
        print(f"order {order} was already paid: {answer.json()['id']}")
    return dict(answer.json())
