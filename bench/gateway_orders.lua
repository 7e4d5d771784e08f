-- POST /orders as a tenant of the run's own ("bench-RUN"), for the gateway benchmark. The
-- argument after `--` is RUN/MODE: RUN a run id, so that keys never repeat across runs (and
-- no run meets the per-tenant key bound because of those before it); MODE "new" for a fresh
-- Idempotency-Key on each request, "same" for one key on all of them.
local threads = 0

function setup(thread)
   threads = threads + 1
   thread:set("tid", threads)
end

function init(args)
   local run, mode = (args[1] or "run/new"):match("([^/]*)/(.*)")
   prefix = run .. "-" .. tostring(tid) .. "-"
   same = mode == "same"
   counter = 0
   wrk.method = "POST"
   wrk.body = '{"sku":"A-1","quantity":2}'
   wrk.headers["Content-Type"] = "application/json"
   wrk.headers["X-Tenant"] = "bench-" .. run
   if same then
      wrk.headers["Idempotency-Key"] = run .. "-replayed"
   end
end

function request()
   if not same then
      counter = counter + 1
      wrk.headers["Idempotency-Key"] = prefix .. counter
   end
   return wrk.format()
end
