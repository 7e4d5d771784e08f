"""The middleware's half: everything that knows ASGI and HTTP, and nothing of SQL.

`middleware.py` reads a keyed request (its key, `keys.py`; its body, `body.py`; its
fingerprint, `fingerprint.py` and `canonical.py`), asks the key store for a claim, and answers:
a replay, a problem (`problems.py` at the package's root), or a run of the application
(`execution.py`), which holds the key by a lease (`lease.py`) or by the store's own
transaction, and settles it (`settlement.py`, reported by `telemetry.py`). `context.py` is
the handler's side (`connection(request)`); `config.py` the options. It speaks to the store
only through the protocol in `_keystore.py`, `_records.py` and `_errors.py`.
"""
