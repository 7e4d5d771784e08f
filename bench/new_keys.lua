-- A fresh Idempotency-Key on every request. Keys are "<run>-<thread>-<n>": the run id comes
-- from the command line (wrk ... -- RUN), the thread number from setup().
local threads = 0

function setup(thread)
   threads = threads + 1
   thread:set("tid", threads)
end

function init(args)
   prefix = (args[1] or "run") .. "-" .. tostring(tid) .. "-"
   counter = 0
   wrk.method = "POST"
   wrk.body = '{"sku":"A-1","quantity":2}'
   wrk.headers["Content-Type"] = "application/json"
end

function request()
   counter = counter + 1
   wrk.headers["Idempotency-Key"] = prefix .. counter
   return wrk.format()
end
