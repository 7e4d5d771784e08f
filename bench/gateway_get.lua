-- GET /items: a request the gateway passes through (no key, not a covered method).
wrk.method = "GET"
