// The activity page: credits, daily spend stacked by model, the org's keys, and its requests
// (pages of GET /v1/generations, and all of them as a CSV download).
// Amounts arrive as exact decimal strings of USD; sums are done in integer nano-dollars
// (BigInt), and only the bar heights use floating point.
"use strict";

const STORAGE_KEY = "kiln.key";
const COLORS = ["#3b6fb6", "#e07b39", "#4a9d5b", "#b94a6a", "#7b5fb0", "#c9a227", "#3aa6a0",
                "#8c6d46"];
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = {width: 720, height: 260, left: 70, right: 10, top: 10, bottom: 30};
const REQUESTS_PAGE = 10;
let nextRequests = null;  // the cursor of the next page of requests, or null

function nanos(usd) {
  const negative = usd.startsWith("-");
  const [whole, fraction = ""] = usd.replace("-", "").split(".");
  const value = BigInt(whole) * 1000000000n + BigInt((fraction + "000000000").slice(0, 9));
  return negative ? -value : value;
}

// An exact decimal string of USD, at least two decimal places ("0.0000186", "-0.50").
function decimal(value) {
  const negative = value < 0n;
  const abs = negative ? -value : value;
  let fraction = (abs % 1000000000n).toString().padStart(9, "0").replace(/0+$/, "");
  fraction = fraction.padEnd(2, "0");
  return (negative ? "-" : "") + (abs / 1000000000n).toString() + "." + fraction;
}

// Dollars as a customer reads them, with the sign ("$0.0000186", "-$0.50"), as the API's
// messages write them.
function usd(value) {
  const text = decimal(value);
  return text.startsWith("-") ? "-$" + text.slice(1) : "$" + text;
}

// An ISO 8601 time (with its offset) in the reader's own time zone, "YYYY-MM-DD HH:MM:SS".
function localTime(iso) {
  const t = new Date(iso);
  const two = n => String(n).padStart(2, "0");
  return t.getFullYear() + "-" + two(t.getMonth() + 1) + "-" + two(t.getDate()) + " " +
    two(t.getHours()) + ":" + two(t.getMinutes()) + ":" + two(t.getSeconds());
}

// The reader's offset from UTC, as "UTC+05:30".
function zoneName() {
  const minutes = -new Date().getTimezoneOffset();
  const abs = Math.abs(minutes);
  return "UTC" + (minutes < 0 ? "-" : "+") + String(Math.floor(abs / 60)).padStart(2, "0") +
    ":" + String(abs % 60).padStart(2, "0");
}

async function api(path, key, method = "GET", payload = undefined) {
  const headers = {Authorization: "Bearer " + key};
  if (payload !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {method, headers,
                                      body: payload === undefined ? undefined
                                                                  : JSON.stringify(payload)});
  const body = await response.json();
  if (!response.ok) {
    throw new Error(body.error ? body.error.message : "HTTP " + response.status);
  }
  return body;
}

// A download needs the key as a header, which a plain link cannot send: the file is fetched
// with it and handed to the browser from memory.
async function download(path, key, filename) {
  const response = await fetch(path, {headers: {Authorization: "Bearer " + key}});
  if (!response.ok) {
    const body = await response.json();
    throw new Error(body.error ? body.error.message : "HTTP " + response.status);
  }
  const url = URL.createObjectURL(await response.blob());
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

function days(start, end) {
  const out = [];
  for (let d = new Date(start + "T00:00:00Z"); d <= new Date(end + "T00:00:00Z");
       d.setUTCDate(d.getUTCDate() + 1)) {
    out.push(d.toISOString().slice(0, 10));
  }
  return out;
}

function svg(name, attributes, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function spendByDay(activity) {
  const byDay = new Map(days(activity.start_date, activity.end_date).map(d => [d, new Map()]));
  const models = [];
  for (const row of activity.data) {
    if (!models.includes(row.model)) models.push(row.model);
    const day = byDay.get(row.date);
    day.set(row.model, (day.get(row.model) || 0n) + nanos(row.cost_usd));
  }
  return {byDay, models};
}

function drawChart(activity) {
  const chart = document.getElementById("chart");
  chart.replaceChildren();
  const {byDay, models} = spendByDay(activity);
  const totals = [...byDay.values()].map(m => [...m.values()].reduce((a, b) => a + b, 0n));
  const top = totals.reduce((a, b) => (b > a ? b : a), 0n);
  const plotW = CHART.width - CHART.left - CHART.right;
  const plotH = CHART.height - CHART.top - CHART.bottom;
  const slot = plotW / byDay.size;
  const base = CHART.top + plotH;
  chart.append(svg("line", {class: "axis", x1: CHART.left, y1: base, x2: CHART.width, y2: base}),
               svg("text", {x: CHART.left - 4, y: CHART.top + 8, "text-anchor": "end"},
                   top > 0n ? usd(top) : "0"),
               svg("text", {x: CHART.left - 4, y: base, "text-anchor": "end"}, "0"));
  [...byDay.entries()].forEach(([day, costs], i) => {
    let y = base;
    const x = CHART.left + i * slot;
    for (const model of models) {
      const cost = costs.get(model) || 0n;
      if (cost <= 0n) continue;
      const h = Number(cost) / Number(top) * plotH;
      y -= h;
      chart.append(svg("rect", {class: "bar", x: x + 1, y, width: Math.max(slot - 2, 1),
                                height: h, fill: COLORS[models.indexOf(model) % COLORS.length],
                                "data-day": day, "data-model": model, "data-cost-usd": decimal(cost)},
                       undefined));
    }
    if (i % 5 === 0) {
      chart.append(svg("text", {x, y: CHART.height - 10}, day.slice(5)));
    }
  });
  drawLegend(models);
}

function drawLegend(models) {
  const legend = document.getElementById("legend");
  legend.replaceChildren(...models.map((model, i) => {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.style.background = COLORS[i % COLORS.length];
    item.append(swatch, model);
    return item;
  }));
}

function showTotals(activity) {
  const total = activity.data.reduce((sum, row) => sum + nanos(row.cost_usd), 0n);
  const requests = activity.data.reduce((sum, row) => sum + row.requests, 0);
  document.getElementById("total").textContent = usd(total);
  document.getElementById("requests").textContent = String(requests);
}

function showCredits(credits) {
  for (const name of ["balance", "held", "available"]) {
    document.getElementById(name).textContent = usd(nanos(credits[name + "_usd"]));
  }
}

// The keys API (docs/KEYS.md), for a management key: create, rotate, revoke.
function newKeyBody() {
  const value = id => document.getElementById(id).value.trim();
  const body = {label: value("new-label") || null, limit_reset: value("new-reset")};
  if (value("new-limit")) body.limit_usd = value("new-limit");
  if (value("new-in-flight")) body.in_flight_limit = Number(value("new-in-flight"));
  if (value("new-models")) body.models = value("new-models").split(",").map(m => m.trim());
  if (value("new-expires")) body.expires_at = new Date(value("new-expires")).toISOString();
  return body;
}

function showSecret(what, answer) {
  const secret = document.getElementById("secret");
  secret.textContent = what + " " + (answer.label || answer.prefix) + ": " + answer.key +
    " (shown once: store it now)";
  secret.dataset.key = answer.key;
  secret.hidden = false;
}

async function manage(action) {
  await act(async key => {
    await action(key);
    const [keys, activity] = await Promise.all([api("/v1/keys", key),
                                                api("/v1/activity", key)]);
    showKeys(keys, activity, key);
  });
}

function keyButton(label, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = label;
  button.addEventListener("click", onClick);
  return button;
}

function showKeys(keys, activity, key) {
  const spent = new Map();
  for (const row of activity.data) {
    spent.set(row.key_prefix, (spent.get(row.key_prefix) || 0n) + nanos(row.cost_usd));
  }
  const money = value => (value === null ? "unlimited" : usd(nanos(value)));
  const caller = keys.data.find(k => key && key.startsWith(k.prefix));
  const managing = Boolean(caller && caller.manage);
  const rows = keys.data.filter(k => !k.revoked).map(k => {
    const tr = document.createElement("tr");
    tr.dataset.prefix = k.prefix;
    const cells = [k.label || "", k.prefix, money(k.limit_usd), k.limit_reset || "never",
                   usd(nanos(k.usage_usd)), money(k.remaining_usd),
                   k.rate_limit ? String(k.rate_limit.requests_per_minute) : "unlimited",
                   usd(spent.get(k.prefix) || 0n),
                   k.last_used_at ? localTime(k.last_used_at) : "never"];
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    const actions = document.createElement("td");
    if (managing && !k.manage) {
      actions.append(
        keyButton("Rotate", () => manage(async secret => showSecret("New secret of",
          await api("/v1/keys/" + k.id + "/rotate", secret, "POST",
                    {grace_period_s: Number(document.getElementById("grace").value || 0)})))),
        keyButton("Revoke", () => manage(secret => api("/v1/keys/" + k.id, secret, "DELETE"))));
    }
    tr.append(actions);
    return tr;
  });
  document.getElementById("key-rows").replaceChildren(...rows);
  document.getElementById("manage").hidden = !managing;
}

function showRequests(page, append) {
  document.getElementById("zone").textContent = zoneName();
  const rows = page.data.map(g => {
    const tr = document.createElement("tr");
    tr.dataset.id = g.id;
    const cells = [localTime(g.created_at), g.model, g.endpoint, g.status,
                   String(g.prompt_tokens), String(g.cached_tokens),
                   String(g.completion_tokens),
                   g.cost_usd === null ? "pending" : usd(nanos(g.cost_usd)),
                   g.key_label || g.key_prefix, g.id];
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.append(td);
    }
    return tr;
  });
  const body = document.getElementById("request-rows");
  if (append) body.append(...rows); else body.replaceChildren(...rows);
  nextRequests = page.next_cursor;
  document.getElementById("more").hidden = nextRequests === null;
}

function requestsPath(cursor) {
  const query = new URLSearchParams({limit: String(REQUESTS_PAGE)});
  if (cursor) query.set("cursor", cursor);
  return "/v1/generations?" + query.toString();
}

// Runs an action of a loaded page (more rows, a download); a failure is shown like a load's.
async function act(action) {
  const error = document.getElementById("error");
  error.hidden = true;
  document.body.dataset.action = "busy";
  try {
    await action(sessionStorage.getItem(STORAGE_KEY));
    document.body.dataset.action = "done";
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
    document.body.dataset.action = "error";
  }
}

async function show(key) {
  const error = document.getElementById("error");
  error.hidden = true;
  try {
    const [credits, keys, activity, requests] = await Promise.all(
      [api("/v1/credits", key), api("/v1/keys", key), api("/v1/activity", key),
       api(requestsPath(null), key)]);
    showCredits(credits);
    showTotals(activity);
    drawChart(activity);
    showKeys(keys, activity, key);
    showRequests(requests, false);
    for (const id of ["credits", "spend", "keys", "request-list"]) {
      document.getElementById(id).hidden = false;
    }
    document.body.dataset.state = "loaded";
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
    document.body.dataset.state = "error";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const input = document.getElementById("key");
  document.getElementById("key-form").addEventListener("submit", event => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    sessionStorage.setItem(STORAGE_KEY, key);
    input.value = "";
    show(key);
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(STORAGE_KEY);
    location.reload();
  });
  document.getElementById("more").addEventListener("click", () => act(
    async key => showRequests(await api(requestsPath(nextRequests), key), true)));
  const csvLink = document.getElementById("csv");
  csvLink.addEventListener("click", event => {
    event.preventDefault();
    act(key => download(csvLink.getAttribute("href"), key, "generations.csv"));
  });
  document.getElementById("new-key").addEventListener("submit", event => {
    event.preventDefault();
    manage(async secret => showSecret("New key",
                                      await api("/v1/keys", secret, "POST", newKeyBody())));
  });
  const saved = sessionStorage.getItem(STORAGE_KEY);
  if (saved) show(saved);
});
