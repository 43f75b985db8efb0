// The playground: a multi-turn chat streamed from /v1/chat/completions (SSE), sampling controls, the exact
// prompt (from /tokenize, then /detokenize of its ids) and, for vision-language models, one image or video file
// per message (a data: URL content part: image_url, or video_url for a video the server samples frames from)
// whose token count /tokenize gives before sending.
// State: `history` holds the finished turns as the API takes them; a stopped answer stays in it as far as it got.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];
let modelName = null;
let controller = null; // the AbortController of the request in flight
let pendingImage = null; // data: URL of the image to send with the next message

function setError(message) {
  $("error").textContent = message || "";
}

function setStatus(text) {
  $("status").textContent = text || "";
}

async function loadModel() {
  try {
    const body = await apiJSON("/v1/models");
    modelName = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = modelName ? "model: " + modelName : "no model";
    setError("");
  } catch (e) {
    $("model-name").textContent = "model unknown";
    if (e.status === 401) showKeyForm(e.message);
    else setError(e.message);
  }
}

function samplingParams() {
  const body = {};
  const number = (id, key, parse) => {
    const raw = $(id).value.trim();
    if (raw !== "") body[key] = parse(raw);
  };
  number("temperature", "temperature", parseFloat);
  number("top_p", "top_p", parseFloat);
  number("max_tokens", "max_tokens", (v) => parseInt(v, 10));
  number("seed", "seed", (v) => parseInt(v, 10));
  const stops = $("stop-seqs").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  return body;
}

// An attachment is its data: URL; its MIME type says whether it is a video.
const isVideo = (url) => url.startsWith("data:video/");

function userMessage(text, image) {
  if (!image) return { role: "user", content: text };
  const parts = [isVideo(image) ? { type: "video_url", video_url: { url: image } } : { type: "image_url", image_url: { url: image } }];
  if (text) parts.push({ type: "text", text: text });
  return { role: "user", content: parts };
}

// The conversation as sent: system prompt, the finished turns, then `extra` (the new message).
function conversation(extra) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  if (extra) messages.push(extra);
  return messages;
}

function addBubble(role, text, image) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  div.appendChild(label);
  if (image && isVideo(image)) {
    const video = document.createElement("video");
    video.src = image;
    video.controls = true;
    video.muted = true;
    video.setAttribute("aria-label", "Video sent with this message");
    div.appendChild(video);
  } else if (image) {
    const img = document.createElement("img");
    img.src = image;
    img.alt = "Image sent with this message";
    div.appendChild(img);
  }
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("transcript").appendChild(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// Reads an SSE body: calls onEvent(parsed JSON) per `data:` line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).replace(/\r$/, "");
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

async function send() {
  if (controller) return;
  const text = $("prompt").value;
  if (!text.trim() && !pendingImage) return;
  setError("");
  const message = userMessage(text, pendingImage);
  const body = Object.assign(
    { model: modelName || undefined, messages: conversation(message), stream: true, stream_options: { include_usage: true } },
    samplingParams()
  );
  controller = new AbortController();
  busy(true);
  setStatus("Waiting for the first token…");
  const started = performance.now();
  let answer = null;
  let text_so_far = "";
  let usage = null;
  try {
    const response = await api("/v1/chat/completions", { json: body, signal: controller.signal });
    if (!response.ok) throw await errorFrom(response);
    // Accepted: the message joins the conversation.
    history.push(message);
    addBubble("user", text, pendingImage);
    $("prompt").value = "";
    clearImage();
    answer = addBubble("assistant", "");
    answer.setAttribute("aria-busy", "true");
    const out = answer.querySelector(".text");
    await readEvents(response, (event) => {
      if (event.error) throw new ApiError(event.error.message || "stream error", event.error.code);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      const piece = choice && choice.delta && choice.delta.content;
      if (piece) {
        text_so_far += piece;
        out.textContent = text_so_far;
        $("transcript").scrollTop = $("transcript").scrollHeight;
        setStatus("Generating…");
      }
    });
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    setStatus(tokens !== null ? tokens + " tokens in " + seconds.toFixed(1) + " s" : "Done");
  } catch (e) {
    if (e.name === "AbortError") {
      setStatus("Stopped");
      if (answer) {
        const note = document.createElement("span");
        note.className = "note";
        note.textContent = " [stopped]";
        answer.appendChild(note);
      }
    } else {
      setStatus("");
      setError(e.message);
      if (e.status === 401) showKeyForm(e.message);
    }
  } finally {
    if (answer) {
      answer.removeAttribute("aria-busy");
      history.push({ role: "assistant", content: text_so_far });
    }
    controller = null;
    busy(false);
    $("prompt").focus();
    if ($("exact").open) showExactPrompt();
  }
}

function stop() {
  if (controller) controller.abort();
}

// ---- images -------------------------------------------------------------------------------
async function tokenCount(messages) {
  const body = await apiJSON("/tokenize", { json: { model: modelName || undefined, messages: messages } });
  return body.count;
}

async function useImage(file) {
  if (!file || !(file.type.startsWith("image/") || file.type.startsWith("video/"))) {
    setError("Not an image or a video: " + (file ? file.type || file.name : "nothing"));
    return;
  }
  const url = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  pendingImage = url;
  const video = isVideo(url);
  $("attachment").hidden = false;
  $("attachment-preview").hidden = video;
  $("attachment-video").hidden = !video;
  if (video) $("attachment-video").src = url;
  else $("attachment-preview").src = url;
  $("image-tokens").textContent = "counting tokens…";
  setError("");
  try {
    // What the image (or video) adds to a message: the same message with and without it.
    const withImage = await tokenCount([userMessage("", url)]);
    const without = await tokenCount([{ role: "user", content: "" }]);
    $("image-tokens").textContent = (video ? "Video: " : "Image: ") + (withImage - without) + " tokens";
    $("image-tokens").dataset.tokens = String(withImage - without);
    if ($("exact").open) showExactPrompt();
  } catch (e) {
    $("image-tokens").textContent = "";
    setError(e.message);
  }
}

function clearImage() {
  pendingImage = null;
  $("attachment").hidden = true;
  $("attachment-preview").removeAttribute("src");
  $("attachment-video").removeAttribute("src");
  $("image-tokens").textContent = "";
  delete $("image-tokens").dataset.tokens;
  $("image-input").value = "";
}

// ---- the exact prompt ---------------------------------------------------------------------
async function showExactPrompt() {
  const text = $("prompt").value;
  const draft = text.trim() || pendingImage ? userMessage(text, pendingImage) : null;
  const messages = conversation(draft);
  if (!messages.length) {
    $("exact-count").textContent = "Nothing to render yet: type a message.";
    $("exact-prompt").textContent = "";
    return;
  }
  $("exact-count").textContent = "rendering…";
  try {
    const tokenized = await apiJSON("/tokenize", {
      json: { model: modelName || undefined, messages: messages, add_generation_prompt: true },
    });
    const detok = await apiJSON("/detokenize", { json: { model: modelName || undefined, tokens: tokenized.tokens } });
    $("exact-count").textContent =
      tokenized.count + " tokens (of " + tokenized.max_model_len + " the model takes), with the chat template applied:";
    $("exact-prompt").textContent = detok.prompt;
  } catch (e) {
    $("exact-count").textContent = "";
    setError(e.message);
  }
}

// ---- wiring -------------------------------------------------------------------------------
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && controller) {
    event.preventDefault();
    stop();
  }
});
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", () => {
  stop();
  history.length = 0;
  $("transcript").textContent = "";
  setError("");
  setStatus("");
  $("prompt").focus();
});
$("image-input").addEventListener("change", (event) => useImage(event.target.files[0]));
$("remove-image").addEventListener("click", clearImage);
const drop = $("drop");
drop.addEventListener("dragover", (event) => {
  event.preventDefault();
  drop.classList.add("over");
});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  if (event.dataTransfer.files.length) useImage(event.dataTransfer.files[0]);
});
$("prompt").addEventListener("paste", (event) => {
  const items = Array.from((event.clipboardData || {}).items || []);
  const image = items.find(
    (item) => item.kind === "file" && (item.type.startsWith("image/") || item.type.startsWith("video/"))
  );
  if (image) {
    event.preventDefault();
    useImage(image.getAsFile());
  }
});
$("exact").addEventListener("toggle", () => {
  if ($("exact").open) showExactPrompt();
});
setupKeyForm(loadModel);
loadModel();
