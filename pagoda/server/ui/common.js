// Shared by the playground and the dashboard: the API key (kept in this browser's localStorage only, sent as
// `Authorization: Bearer` on API calls), fetch with that header, and OpenAI-style error messages.
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
