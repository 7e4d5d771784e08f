-- A fresh Idempotency-Key on every request, for one of 64 tenants at random (x-tenant, as
-- tests/apps.py reads it): on a Citus cluster the requests spread over every shard.
-- Keys are "<run>-<thread>-<n>": the run id and the path come from the command line
-- (wrk ... -- RUN PATH).
local threads = 0

function setup(thread)
   threads = threads + 1
   thread:set("tid", threads)
end

function init(args)
   prefix = (args[1] or "run") .. "-" .. tostring(tid) .. "-"
   counter = 0
   wrk.method = "POST"
   wrk.path = args[2] or "/tx/charge"
   wrk.body = '{"sku":"A-1","quantity":2}'
   wrk.headers["Content-Type"] = "application/json"
end

function request()
   counter = counter + 1
   wrk.headers["Idempotency-Key"] = prefix .. counter
   wrk.headers["x-tenant"] = "tenant-" .. tostring(counter % 64)
   return wrk.format()
end
