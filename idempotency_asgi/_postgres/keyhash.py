"""Names derived from a key (its tenant and the key itself) that the database sees in place
of the key: fixed length, the same in every process, nothing of the key in clear."""

from __future__ import annotations

import hashlib


def wake_token(tenant: str, key: str) -> str:
    """The NOTIFY payload naming one key (`sql/waiting.wake_token` computes the same)."""
    return hashlib.sha256(f"{len(tenant)}:{tenant}{key}".encode()).hexdigest()[:32]


def key_lock(tenant: str, key: str) -> int:
    """The key's advisory lock: a 64-bit hash of the tenant and the key, as PostgreSQL's
    bigint lock ids are (signed). An atomic-mode transaction holds it while it runs the key;
    a claim in the other modes tries it (shared) before it inserts a new key. Two keys share
    a lock with a chance of one in 2^64 (about n in 2^64 with n keys in flight at once):
    then, while one of them runs in the atomic mode, a request on the other finds its own
    request's lock free and the key's held, and is told 422 `key-reused` (or 409, when the
    lock was taken between its look and its BEGIN). Never the other key's answer, never both
    run as one; once the first ends, a retry runs."""
    return _lock_id(f"{len(tenant)}:{tenant}{key}".encode())


def request_lock(tenant: str, key: str, fingerprint: bytes) -> int:
    """The advisory lock of one request on the key (its fingerprint too): an atomic-mode
    transaction holds it beside the key's, so that a request in flight is told apart from a
    different one reusing its key (409 against 422) before anything is written."""
    return _lock_id(f"{len(tenant)}:{tenant}{len(key)}:{key}".encode() + fingerprint)


def _lock_id(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)
