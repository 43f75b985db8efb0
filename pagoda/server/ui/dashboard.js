// The live dashboard: one /metrics snapshot a second (Prometheus text, parsed here), turned into rates and
// last-minute percentiles client side, each drawn as a small line chart on a <canvas>.
// Rates come from the two newest snapshots; percentiles and ratios "over the last minute" from the newest one
// and the oldest one kept (at most WINDOW_S old): counters and histogram buckets only grow, so their deltas
// are what happened in between. A server restart (a counter going down) restarts the window.
// The parser, percentiles and charts are in common.js. Names: vLLM's `vllm:` and Pagoda's `pagoda:` carry the same values; either or both may be exported.
"use strict";

const WINDOW_S = 60;
const PREFIXES = ["vllm:", "pagoda:"];

class Snapshot {
  constructor(families, time) {
    this.families = families;
    this.time = time;
    this.prefix = PREFIXES.find((p) => Object.keys(families).some((k) => k.startsWith(p))) || "vllm:";
  }
  samples(name) {
    return this.families[this.prefix + name] || [];
  }
  // The sum over all label sets (one model per server; several API processes are already summed).
  total(name, match) {
    let sum = 0, seen = false;
    for (const s of this.samples(name)) {
      if (match && !Object.keys(match).every((k) => s.labels[k] === match[k])) continue;
      sum += s.value;
      seen = true;
    }
    return seen ? sum : null;
  }
  // Histogram buckets as [[le, cumulative count]], sorted, +Inf last.
  buckets(name) {
    const byLe = new Map();
    for (const s of this.samples(name + "_bucket")) {
      const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
      byLe.set(le, (byLe.get(le) || 0) + s.value);
    }
    return Array.from(byLe.entries()).sort((a, b) => a[0] - b[0]);
  }
}

const snapshots = []; // newest last, covering at most WINDOW_S
const $ = (id) => document.getElementById(id);

function render() {
  const now = snapshots[snapshots.length - 1];
  const prev = snapshots.length > 1 ? snapshots[snapshots.length - 2] : null;
  const old = snapshots[0];
  const dt = prev ? now.time - prev.time : 0;
  const span = now.time - old.time;
  const rate = (name, match) => {
    if (!prev || dt <= 0) return null;
    const a = now.total(name, match), b = prev.total(name, match);
    return a === null || b === null ? null : Math.max(0, a - b) / dt;
  };
  const windowDelta = (name, match) => {
    const a = now.total(name, match), b = old.total(name, match);
    return a === null ? null : a - (snapshots.length > 1 && b !== null ? b : 0);
  };

  const tokRate = rate("generation_tokens_total");
  update("tokens", "Output tokens/s", [tokRate], fmt(tokRate, 1), "prompt tokens/s: " + fmt(rate("prompt_tokens_total"), 1));

  const running = now.total("num_requests_running"), waiting = now.total("num_requests_waiting");
  update("requests", "Requests running / waiting", [running, waiting], fmt(running, 0) + " / " + fmt(waiting, 0), "blue running, orange waiting");

  const kv = now.total("kv_cache_usage_perc");
  update("kv", "KV cache usage", [kv === null ? null : kv * 100], fmt(kv === null ? null : kv * 100, 1, " %"));

  // Only on CUDA servers (NVML): the series is absent elsewhere, and so is the card.
  const gpus = now.samples("gpu_utilization_perc");
  if (gpus.length) {
    const mean = (100 * gpus.reduce((sum, s) => sum + s.value, 0)) / gpus.length;
    const each = gpus.map((s) => "GPU " + s.labels.gpu + ": " + fmt(s.value * 100, 0, " %")).join(" · ");
    update("gpu", "GPU utilisation", [mean], fmt(mean, 0, " %"), each);
  }

  const within = snapshots.length > 1 ? old : null;
  for (const [id, title, name] of [
    ["ttft", "Time to first token (last minute)", "time_to_first_token_seconds"],
    ["itl", "Inter-token latency (last minute)", "inter_token_latency_seconds"],
    ["tpot", "Time per output token, per request (last minute)", "request_time_per_output_token_seconds"],
  ]) {
    const newer = now.buckets(name), older = within ? within.buckets(name) : null;
    const p50 = ms(quantile(0.5, newer, older)), p90 = ms(quantile(0.9, newer, older)), p99 = ms(quantile(0.99, newer, older));
    update(id, title, [p50, p99], "p50 " + fmt(p50, 1, " ms"), "p90 " + fmt(p90, 1, " ms") + " · p99 " + fmt(p99, 1, " ms"));
  }

  const preemptions = now.total("num_preemptions_total");
  const aborts = now.total("request_success_total", { finished_reason: "abort" });
  update("preemptions", "Preemptions", [rate("num_preemptions_total")], fmt(preemptions, 0), "aborted requests: " + fmt(aborts, 0));

  const hits = windowDelta("prefix_cache_hits_total"), queries = windowDelta("prefix_cache_queries_total");
  const hitRate = queries ? (100 * hits) / queries : null;
  update("prefix", "Prefix-cache hit rate (last minute)", [hitRate], fmt(hitRate, 1, " %"), "tokens looked up: " + fmt(queries, 0));

  // Only once speculative decoding has verified proposals: vLLM's acceptance length, the tokens one
  // verified row yields (the proposals it kept and the model's own token), over the last minute.
  if (now.total("spec_decode_num_drafts_total")) {
    const drafts = windowDelta("spec_decode_num_drafts_total"), drafted = windowDelta("spec_decode_num_draft_tokens_total");
    const accepted = windowDelta("spec_decode_num_accepted_tokens_total");
    const length = drafts ? 1 + accepted / drafts : null, kept = drafted ? (100 * accepted) / drafted : null;
    update("spec", "Speculative decoding: acceptance length (last minute)", [length], fmt(length, 2, " tokens"), "proposals accepted: " + fmt(kept, 0, " %") + " · rows verified: " + fmt(drafts, 0));
  }

  // Only with --enable-lora (vLLM's lora_requests_info): the adapters of the running and the waiting requests.
  const lora = now.samples("lora_requests_info")[0];
  if (lora) {
    const names = (list) => (list ? list.split(",").length : 0);
    const run = lora.labels.running_lora_adapters, wait = lora.labels.waiting_lora_adapters;
    update("lora", "LoRA adapters running (of " + lora.labels.max_lora + " a step)", [names(run)], String(names(run)), "running: " + (run || "none") + " · waiting: " + (wait || "none"));
  }

  // Per step over the last second: host time is the busy time less the wait for the device's tokens.
  const steps = rate("engine_steps_total"), busy = rate("engine_core_busy_seconds_total"), wait = rate("engine_core_device_wait_seconds_total");
  let host = null, device = null;
  if (steps && busy !== null && wait !== null) {
    host = ((busy - wait) / steps) * 1000;
    device = (wait / steps) * 1000;
  }
  update("step", "Engine step: host / device wait", [host, device], fmt(host, 2, " ms") + " / " + fmt(device, 2, " ms"), "steps/s: " + fmt(steps, 1));

  const names = now.samples("generation_tokens_total").map((s) => s.labels.model_name).filter(Boolean);
  if (names.length) $("model-name").textContent = "model: " + names[0];
  $("status").textContent = "Updated " + new Date().toLocaleTimeString() + " · window " + span.toFixed(0) + " s · " + now.prefix + "*";
}

let timer = null;
async function poll() {
  try {
    const response = await api("/metrics", { cache: "no-store" });
    if (response.status === 401) {
      showKeyForm((await errorFrom(response)).message);
      return; // the key form restarts polling
    }
    if (!response.ok) throw await errorFrom(response);
    const snap = new Snapshot(parseMetrics(await response.text()), performance.now() / 1000);
    const last = snapshots[snapshots.length - 1];
    if (last && (snap.total("generation_tokens_total") || 0) < (last.total("generation_tokens_total") || 0)) {
      snapshots.length = 0; // the server restarted
    }
    snapshots.push(snap);
    while (snapshots.length > 2 && snap.time - snapshots[1].time >= WINDOW_S) snapshots.shift();
    $("error").textContent = "";
    render();
  } catch (e) {
    $("error").textContent = "Cannot read /metrics: " + e.message;
  }
  timer = setTimeout(poll, 1000);
}

setupKeyForm(() => {
  clearTimeout(timer);
  poll();
});
poll();
