-- wrk script: POST a small non-stream chat completion.
-- Env: BENCH_API_KEY (bearer token, optional), BENCH_MODEL (default bench-model).
local key = os.getenv("BENCH_API_KEY") or ""
local model = os.getenv("BENCH_MODEL") or "bench-model"

wrk.method = "POST"
wrk.path = wrk.path ~= "/" and wrk.path or "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end
wrk.body = '{"model":"' .. model .. '","max_tokens":16,' ..
  '"messages":[{"role":"user","content":"Say hello in one short sentence."}]}'

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
