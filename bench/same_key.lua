-- The same Idempotency-Key on every request: after the first, all are replays.
wrk.method = "POST"
wrk.body = '{"sku":"A-1","quantity":2}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = "bench-replayed-key"
