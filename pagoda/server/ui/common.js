// Shared by the pages (playground, dashboard, the router's page): the API key (kept in this browser's localStorage
// only, sent as `Authorization: Bearer` on API calls), fetch with that header, OpenAI-style error messages, and
// for the dashboards the Prometheus text parser, histogram percentiles and the hand-drawn line charts.
"use strict";

const KEY_STORAGE = "pagoda.apiKey";

function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch (e) {
    return "";
  }
}

function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch (e) {
    /* storage disabled: the key lives for this page only */
  }
  window.__pagodaKey = key;
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = window.__pagodaKey || apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// fetch() with the key; `json`: a body to send as JSON.
function api(path, options) {
  const opts = Object.assign({}, options || {});
  const extra = {};
  if (opts.json !== undefined) {
    extra["Content-Type"] = "application/json";
    opts.body = JSON.stringify(opts.json);
    delete opts.json;
    if (!opts.method) opts.method = "POST";
  }
  opts.headers = authHeaders(Object.assign(extra, opts.headers || {}));
  return fetch(path, opts);
}

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// The server's own message from an error response ({"error": {"message": ...}}), or the status line.
async function errorFrom(response) {
  let message = "HTTP " + response.status + " " + (response.statusText || "");
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
    else if (body && body.detail) message = String(body.detail);
  } catch (e) {
    /* not JSON: keep the status line */
  }
  return new ApiError(message.trim(), response.status);
}

async function apiJSON(path, options) {
  const response = await api(path, options);
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

// The key form (shown when the server answers 401): saving it stores the key and calls `onSaved`.
function setupKeyForm(onSaved) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  if (!form || !input) return;
  input.value = apiKey();
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(input.value.trim());
    form.hidden = true;
    onSaved();
  });
}

function showKeyForm(message) {
  const form = document.getElementById("key-form");
  if (!form) return;
  form.hidden = false;
  const note = document.getElementById("key-note");
  if (note) note.textContent = message || "This server needs an API key.";
  document.getElementById("api-key").focus();
}

// ---- metrics and charts -------------------------------------------------------------------
const HISTORY = 120; // chart points (one a second)

// Prometheus text -> {name: [{labels, value}]}
function parseMetrics(text) {
  const out = {};
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line[0] === "#") continue;
    let name, labels = {}, rest;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    if (brace >= 0 && (space < 0 || brace < space)) {
      name = line.slice(0, brace);
      const close = line.indexOf("}", brace);
      const body = line.slice(brace + 1, close);
      const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
      let m;
      while ((m = re.exec(body)) !== null) labels[m[1]] = m[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      rest = line.slice(close + 1).trim();
    } else {
      name = line.slice(0, space);
      rest = line.slice(space + 1).trim();
    }
    const value = parseFloat(rest.split(/\s+/)[0]);
    (out[name] = out[name] || []).push({ labels: labels, value: value });
  }
  return out;
}

// The q-quantile of the observations between two bucket snapshots (linear inside a bucket), or null if none.
function quantile(q, newer, older) {
  const before = new Map(older || []);
  const deltas = newer.map(([le, count]) => [le, count - (before.get(le) || 0)]);
  if (!deltas.length) return null;
  const total = deltas[deltas.length - 1][1];
  if (!(total > 0)) return null;
  const target = q * total;
  let lower = 0, below = 0;
  for (const [le, cumulative] of deltas) {
    if (cumulative >= target) {
      if (le === Infinity) return lower;
      const inBucket = cumulative - below;
      return inBucket > 0 ? lower + (le - lower) * ((target - below) / inBucket) : le;
    }
    lower = le;
    below = cumulative;
  }
  return lower;
}

// A small line chart of one or more series (newest point at the right edge, `HISTORY` points wide,
// null for a gap), scaled to the largest value shown; data-points / data-max say what it drew.
function draw(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 200, height = canvas.clientHeight || 60;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  let max = 0;
  for (const s of series) for (const v of s) if (v !== null && v > max) max = v;
  if (max <= 0) max = 1;
  const style = getComputedStyle(document.documentElement);
  const colors = [style.getPropertyValue("--chart").trim() || "#2457c5", style.getPropertyValue("--chart2").trim() || "#c55a24"];
  ctx.strokeStyle = style.getPropertyValue("--border").trim() || "#ccc";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(0, height - 0.5);
  ctx.lineTo(width, height - 0.5);
  ctx.stroke();
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i % colors.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    points.forEach((v, j) => {
      if (v === null) {
        pen = false;
        return;
      }
      const x = width - (points.length - 1 - j) * (width / (HISTORY - 1));
      const y = height - 2 - (v / max) * (height - 6);
      if (pen) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  });
  canvas.dataset.points = String(series[0].filter((v) => v !== null).length);
  canvas.dataset.max = String(max);
}


const charts = {};

function fmt(value, digits, unit) {
  if (value === null || value === undefined || !isFinite(value)) return "–";
  return value.toFixed(digits) + (unit || "");
}

function ms(seconds) {
  return seconds === null ? null : seconds * 1000;
}

// One card in #cards: a title, the current value, a sub-line and a chart of one or two series.
function card(id, title, seriesNames) {
  if (charts[id]) return charts[id];
  const el = document.createElement("section");
  el.className = "card";
  el.id = "card-" + id;
  el.setAttribute("aria-labelledby", "title-" + id);
  el.innerHTML =
    '<h2 id="title-' + id + '"></h2><div class="value" id="value-' + id + '">–</div>' +
    '<div class="sub" id="sub-' + id + '"></div><canvas id="chart-' + id + '" role="img"></canvas>';
  el.querySelector("h2").textContent = title;
  el.querySelector("canvas").setAttribute("aria-label", title + " over the last " + HISTORY + " seconds");
  document.getElementById("cards").appendChild(el);
  charts[id] = { el: el, series: seriesNames.map(() => []), names: seriesNames };
  return charts[id];
}

function update(id, title, values, text, sub) {
  const c = card(id, title, values.map((_, i) => i));
  values.forEach((v, i) => {
    c.series[i].push(v === null || !isFinite(v) ? null : v);
    if (c.series[i].length > HISTORY) c.series[i].shift();
  });
  document.getElementById("value-" + id).textContent = text;
  document.getElementById("sub-" + id).textContent = sub || "";
  draw(document.getElementById("chart-" + id), c.series);
}
