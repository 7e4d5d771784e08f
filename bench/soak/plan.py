"""What the soak sends: keys, their bodies, and which of them get duplicates or faults.

Every key is one of four kinds:

- `single`: one request.
- `concurrent`: two or three identical requests written on separate connections at the same
  moment. Expected: one original 201, the others 409 (with Retry-After) or replays.
- `delayed`: one request, then the same request again 1 to `delay_max` seconds after its
  answer arrived. Expected: a replay of the original, byte for byte.
- `fault`: one request with `X-Fault-Status: 500` (the handler writes, then answers 500: the
  transaction rolls back and the key is released). Never retried. Expected: a 500 and no
  payment.

Both tenants use the same key strings (`soak-<run>-<n>` for acme's n-th key and globex's n-th
key): each is a key of its own, with its own body, so a key that leaked across tenants would
show as a wrong replay or a second payment. The counts are exact: `duplicate_share` of all
requests are duplicates, half of them concurrent and half delayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SINGLE, CONCURRENT, DELAYED, FAULT = "single", "concurrent", "delayed", "fault"
TENANTS = (("acme", "sk_test_acme"), ("globex", "sk_test_globex"))


@dataclass(frozen=True, slots=True)
class Job:
    index: int  # position in the plan; the key's number in the answer log
    tenant: str
    token: str
    key: str
    kind: str
    copies: int  # requests sent at first (2 or 3 for concurrent, else 1)
    body: bytes

    @property
    def requests(self) -> int:
        return self.copies + (1 if self.kind == DELAYED else 0)


@dataclass(frozen=True)
class Counts:
    requests: int
    keys: int
    singles: int
    concurrent_pairs: int
    concurrent_triples: int
    delayed: int
    faults: int

    @property
    def duplicates(self) -> int:
        return self.concurrent_pairs + 2 * self.concurrent_triples + self.delayed


def counts(requests: int, duplicate_share: float, faults: int) -> Counts:
    duplicates = round(requests * duplicate_share)
    delayed = duplicates // 2
    concurrent_extra = duplicates - delayed
    triples = concurrent_extra // 4  # two extra copies each
    pairs = concurrent_extra - 2 * triples  # one extra copy each
    singles = requests - faults - 2 * delayed - 3 * triples - 2 * pairs
    if singles < 0:
        raise ValueError(f"{requests} requests cannot hold {duplicates} duplicates and {faults}")
    return Counts(
        requests=requests,
        keys=singles + pairs + triples + delayed + faults,
        singles=singles,
        concurrent_pairs=pairs,
        concurrent_triples=triples,
        delayed=delayed,
        faults=faults,
    )


def jobs(run_id: str, plan: Counts, seed: int) -> list[Job]:
    """The keys in the order they are sent (shuffled, reproducible from the seed)."""
    rng = random.Random(seed)
    kinds: list[tuple[str, int]] = (
        [(SINGLE, 1)] * plan.singles
        + [(CONCURRENT, 2)] * plan.concurrent_pairs
        + [(CONCURRENT, 3)] * plan.concurrent_triples
        + [(DELAYED, 1)] * plan.delayed
        + [(FAULT, 1)] * plan.faults
    )
    rng.shuffle(kinds)
    out = []
    for index, (kind, copies) in enumerate(kinds):
        tenant, token = TENANTS[index % 2]
        number = index // 2
        amount = rng.randint(100, 999_999)
        currency = rng.choice(("EUR", "USD", "GBP"))
        body = (
            f'{{"amount": {amount}, "currency": "{currency}", '
            f'"customer_id": "cus_{tenant}_{number % 5000}"}}'
        ).encode()
        out.append(Job(index, tenant, token, f"soak-{run_id}-{number:07d}", kind, copies, body))
    return out
