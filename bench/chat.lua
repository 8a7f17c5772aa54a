-- wrk script: POST a small non-stream chat completion (or BENCH_BODY, a JSON body, to the
-- URL's path: /v1/responses for the Responses API).
-- Env: BENCH_API_KEY (bearer token, optional), BENCH_MODEL (default bench-model),
--      BENCH_API_KEYS (comma-separated; thread i uses key i, so with -tN -cN every
--      connection has a key of its own, e.g. one per org).
local key = os.getenv("BENCH_API_KEY") or ""
local model = os.getenv("BENCH_MODEL") or "bench-model"

wrk.method = "POST"
wrk.path = wrk.path ~= "/" and wrk.path or "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end
wrk.body = os.getenv("BENCH_BODY") or ('{"model":"' .. model .. '","max_tokens":16,' ..
  '"messages":[{"role":"user","content":"Say hello in one short sentence."}]}')

local keys = {}
for k in string.gmatch(os.getenv("BENCH_API_KEYS") or "", "[^,]+") do
  keys[#keys + 1] = k
end
local threads = 0

-- Runs in the main state once per thread, before that thread's init.
function setup(thread)
  threads = threads + 1
  if #keys > 0 then
    thread:set("thread_key", keys[(threads - 1) % #keys + 1])
  end
end

-- Runs in the thread's own state, before its request is built.
function init(args)
  if thread_key then
    wrk.headers["Authorization"] = "Bearer " .. thread_key
  end
end

-- Print one machine-readable line; wrk's own text report comes before it.
function done(summary, latency, requests)
  local errs = summary.errors
  io.write(string.format(
    "WRK_JSON {\"requests\":%d,\"duration_us\":%d,\"rps\":%.2f," ..
    "\"p50_us\":%d,\"p90_us\":%d,\"p99_us\":%d,\"max_us\":%d,\"mean_us\":%.1f," ..
    "\"connect_errors\":%d,\"read_errors\":%d,\"write_errors\":%d," ..
    "\"timeouts\":%d,\"non2xx\":%d}\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean,
    errs.connect, errs.read, errs.write, errs.timeout, errs.status))
end
