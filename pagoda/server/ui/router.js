// The router's live page: /health (JSON: each backend's health, breaker, in-flight count, models) and /metrics
// (`pagoda_router:` counters and histograms) once a second; rates from the two newest snapshots, the affinity
// hit rate and time-to-first-byte percentiles over the last minute (the newest against the oldest kept).
// Both endpoints are open on the router, so this page needs no key; it shows key labels, never keys.
"use strict";

const P = "pagoda_router:";
const WINDOW_S = 60;
const CIRCUIT = { 0: "closed", 1: "half-open", 2: "open" };
const $ = (id) => document.getElementById(id);
const snapshots = []; // {families, time}, newest last

function sum(snap, name, match) {
  if (!snap) return null;
  let total = 0, seen = false;
  for (const s of snap.families[P + name] || []) {
    if (match && !Object.keys(match).every((k) => s.labels[k] === match[k])) continue;
    total += s.value;
    seen = true;
  }
  return seen ? total : null;
}

// Distinct values of `label` over the samples of `name`.
function labelValues(snap, name, label) {
  return Array.from(new Set((snap.families[P + name] || []).map((s) => s.labels[label]).filter((v) => v !== undefined)));
}

function buckets(snap, name) {
  const byLe = new Map();
  for (const s of snap.families[P + name + "_bucket"] || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return Array.from(byLe.entries()).sort((a, b) => a[0] - b[0]);
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
}

function render(health) {
  const now = snapshots[snapshots.length - 1];
  const prev = snapshots.length > 1 ? snapshots[snapshots.length - 2] : null;
  const old = snapshots.length > 1 ? snapshots[0] : null;
  const dt = prev ? now.time - prev.time : 0;
  const rate = (name, match) => {
    const a = sum(now, name, match), b = sum(prev, name, match);
    return dt > 0 && a !== null ? Math.max(0, a - (b || 0)) / dt : null;
  };
  const inWindow = (name, match) => {
    const a = sum(now, name, match);
    return a === null ? null : a - (old ? sum(old, name, match) || 0 : 0);
  };
  const hitRate = (match) => {
    const hits = inWindow("affinity_total", Object.assign({ result: "hit" }, match || {})) || 0;
    const misses = inWindow("affinity_total", Object.assign({ result: "miss" }, match || {})) || 0;
    return hits + misses > 0 ? (100 * hits) / (hits + misses) : null;
  };

  const backends = health.backends || [];
  $("policy").textContent = "policy: " + (health.policy || "?") + " · " + backends.filter((b) => b.healthy).length + "/" + backends.length + " healthy";

  const requests = rate("requests_total");
  update("requests", "Requests/s", [requests], fmt(requests, 1), "answered, all backends");
  const inflight = backends.reduce((n, b) => n + (b.inflight || 0), 0);
  update("inflight", "In flight", [inflight], fmt(inflight, 0), "long queue: " + fmt(sum(now, "long_queue_waiting"), 0) + " waiting");
  const hits = hitRate();
  update("affinity", "Affinity hit rate (last minute)", [hits], fmt(hits, 1, " %"), "session served by its ring owner");
  const newer = buckets(now, "time_to_first_byte_seconds"), older = old ? buckets(old, "time_to_first_byte_seconds") : null;
  const p50 = ms(quantile(0.5, newer, older)), p99 = ms(quantile(0.99, newer, older));
  update("ttfb", "Time to first byte (last minute)", [p50, p99], "p50 " + fmt(p50, 1, " ms"), "p99 " + fmt(p99, 1, " ms"));
  const errors = prev ? rate("backend_errors_total") || 0 : null; // no series yet: no error yet
  update("errors", "Backend errors/s", [errors], fmt(errors, 2), "retries: " + fmt(sum(now, "retries_total") || 0, 0) + " · rejected: " + fmt(sum(now, "rejected_total") || 0, 0));

  const body = $("backends").querySelector("tbody");
  body.textContent = "";
  for (const b of backends) {
    const row = document.createElement("tr");
    row.dataset.backend = b.name;
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = b.name + (b.url && b.url !== b.name ? " (" + b.url + ")" : "");
    row.appendChild(th);
    cell(row, b.healthy ? "up" : "down", b.healthy ? "ok" : "bad");
    cell(row, b.circuit || CIRCUIT[sum(now, "circuit_state", { backend: b.name })] || "?", b.circuit === "open" ? "bad" : "");
    cell(row, String(b.inflight));
    cell(row, fmt(rate("requests_total", { backend: b.name }), 1));
    cell(row, fmt(hitRate({ backend: b.name }), 1, " %"));
    cell(row, fmt(sum(now, "backend_errors_total", { backend: b.name }) || 0, 0));
    cell(row, (b.models || []).join(", "));
    cell(row, b.last_probe_error || "");
    body.appendChild(row);
  }

  const keys = $("keys").querySelector("tbody");
  keys.textContent = "";
  for (const key of labelValues(now, "key_requests_total", "key").sort()) {
    const row = document.createElement("tr");
    row.dataset.key = key;
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = key;
    row.appendChild(th);
    cell(row, fmt(sum(now, "key_requests_total", { key: key }), 0));
    cell(row, fmt(sum(now, "prompt_tokens_total", { key: key }) || 0, 0));
    cell(row, fmt(sum(now, "completion_tokens_total", { key: key }) || 0, 0));
    cell(row, fmt(rate("completion_tokens_total", { key: key }), 1));
    keys.appendChild(row);
  }
  $("status").textContent = "Updated " + new Date().toLocaleTimeString();
}

async function poll() {
  try {
    // /health answers 503 (still with the JSON) when no backend is healthy: that is news, not an error.
    const [healthResponse, metricsResponse] = await Promise.all([
      fetch("/health", { cache: "no-store" }),
      fetch("/metrics", { cache: "no-store" }),
    ]);
    if (!metricsResponse.ok) throw await errorFrom(metricsResponse);
    const health = await healthResponse.json();
    const snap = { families: parseMetrics(await metricsResponse.text()), time: performance.now() / 1000 };
    snapshots.push(snap);
    while (snapshots.length > 2 && snap.time - snapshots[1].time >= WINDOW_S) snapshots.shift();
    $("error").textContent = "";
    render(health);
  } catch (e) {
    $("error").textContent = "Cannot read the router's state: " + e.message;
  }
  setTimeout(poll, 1000);
}

poll();
