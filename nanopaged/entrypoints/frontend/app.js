// nanopaged's page: a chat playground that streams /v1/chat/completions, and a dashboard that
// polls /dashboard.json once a second. Plain browser JavaScript, no framework, no remote asset.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "nanopaged-api-key";   // this tab only (sessionStorage): gone when it closes
const POLL_MS = 1000;

const state = {
  key: sessionStorage.getItem(KEY_STORAGE),   // the API key, once the server asked for one
  keyPrompt: null,                            // a promise while the key dialog is open
  messages: [],                               // the conversation: {role, content}, system prompt aside
  controller: null,                           // aborts the answer being streamed
};

// ---- the server's routes, with the key when there is one ---------------------------------------
async function api(path, init = {}) {
  for (;;) {
    const headers = { ...(init.headers || {}) };
    if (state.key) headers.Authorization = "Bearer " + state.key;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    await askForKey(state.key ? "The server refused that key; try another." : "This server wants an API key.");
  }
}

function askForKey(reason) {
  // Every route that meets a 401 waits on the same dialog; the key is sent as a Bearer token from then on.
  if (!state.keyPrompt) {
    state.keyPrompt = new Promise((resolve) => {
      $("key-reason").textContent = reason;
      $("key-input").value = "";
      $("key-form").onsubmit = (event) => {
        event.preventDefault();
        state.key = $("key-input").value.trim();
        sessionStorage.setItem(KEY_STORAGE, state.key);
        $("key-dialog").close();
        state.keyPrompt = null;
        resolve();
      };
      $("key-dialog").showModal();
    });
  }
  return state.keyPrompt;
}

async function errorText(response) {
  // OpenAI's error body ({"error": {"message"}}) when the server sent one, else the status line.
  try {
    return (await response.json()).error.message;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ---- the playground ----------------------------------------------------------------------------
async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) return setStatus("models: " + (await errorText(response)));
  const select = $("model");
  for (const card of (await response.json()).data) {
    const label = card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
    select.append(new Option(label, card.id));
  }
}

function request() {
  // The chat request the fields describe; the conversation so far, the system prompt first.
  const system = $("system").value.trim();
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  const body = {
    model: $("model").value,
    messages: [...(system ? [{ role: "system", content: system }] : []), ...state.messages],
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if (stop.length) body.stop = stop;
  return body;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;                 // text, never HTML: the model's output is not markup
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  answer.dataset.state = "streaming";
  state.controller = new AbortController();
  setBusy(true);
  let content = "";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request()), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of serverSentEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      content += (chunk.choices[0] && chunk.choices[0].delta.content) || "";
      answer.textContent = content;
    }
    answer.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      answer.dataset.state = "done";      // stopped: what came so far stays the answer
    } else {
      answer.dataset.state = "error";
      answer.textContent = content + (content ? "\n" : "") + "error: " + error.message;
    }
  } finally {
    setBusy(false);
  }
  if (answer.dataset.state === "done") state.messages.push({ role: "assistant", content });
  else state.messages.pop();              // not answered: the next message goes on from before it
}

async function* serverSentEvents(response) {
  // Each `data: ...` line of the stream, as the chunks arrive (an event may span two chunks).
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

function setBusy(busy) {
  $("send").disabled = $("clear").disabled = busy;
  $("stop-button").disabled = !busy;
}

function setStatus(text) {
  $("status").textContent = text;
}

// ---- the dashboard -----------------------------------------------------------------------------
const percent = (x) => (x === null ? "-" : `${(100 * x).toFixed(0)}%`);
const number = (x) => (x === null ? "-" : x >= 100 ? x.toFixed(0) : x.toFixed(1));

// Each card: the series its chart draws (a value per point; null leaves a gap), the chart's top (a
// number, or null for the series' own peak), and its text: the figures now, then a line about the window.
const CARDS = {
  kv: {
    series: [(p) => p.kv_cache_usage], top: 1,
    text: (now, ps) => [percent(now.kv_cache_usage), "peak " + percent(peak(ps, (p) => p.kv_cache_usage))],
  },
  preemptions: {
    series: [(p) => p.num_preemptions], top: null,
    text: (now, ps) => [String(now.num_preemptions), `+${now.num_preemptions - ps[0].num_preemptions} in the window`],
  },
  requests: {
    series: [(p) => p.num_running, (p) => p.num_waiting], top: null,
    text: (now, ps) => [`${now.num_running} / ${now.num_waiting}`, `peak waiting ${peak(ps, (p) => p.num_waiting)}`],
  },
  prefix: {
    series: [(p) => p.prefix_cache_hit_rate], top: 1,
    text: (now, ps) => {
      const hits = now.prefix_cache_hits - ps[0].prefix_cache_hits;
      const queries = now.prefix_cache_queries - ps[0].prefix_cache_queries;
      return [queries > 0 ? percent(hits / queries) : "-", `${hits} of ${queries} prompt tokens in the window`];
    },
  },
  tokens: {
    series: [(p) => p.generation_tokens_per_s], top: null,
    text: (now, ps) => [number(recentRate(ps, 5)), "peak " + number(peak(ps, (p) => p.generation_tokens_per_s))],
  },
};

const last = (points) => points[points.length - 1];

function peak(points, value) {
  const values = points.map(value).filter((v) => v !== null);
  return values.length ? Math.max(...values) : null;
}

function recentRate(points, seconds) {
  // Tokens a second over the last `seconds`: steadier than one interval's rate.
  const recent = points.filter((p) => p.age_s <= seconds);
  const first = recent.length > 1 ? recent[0] : points[Math.max(0, points.length - 2)];
  const span = first.age_s - last(points).age_s;
  return span > 0 ? (last(points).num_generated_tokens - first.num_generated_tokens) / span : 0;
}

const SVG = "http://www.w3.org/2000/svg";   // the SVG namespace's name, not an address the page loads
const WIDTH = 300, HEIGHT = 60;

function chart(card) {
  // One <svg> per card, one <path> per series, made once; each poll only rewrites the paths.
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("aria-hidden", "true");
  const paths = CARDS[card.dataset.card].series.map((_, i) => {
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("class", "series-" + i);
    svg.append(path);
    return path;
  });
  card.append(svg);
  return paths;
}

function pathData(points, value, top, windowS) {
  // x: the point's age (now at the right edge); y: value / top. A null value lifts the pen.
  let d = "", pen = false;
  for (const p of points) {
    const v = value(p);
    if (v === null) { pen = false; continue; }
    const x = WIDTH * (1 - p.age_s / windowS);
    const y = HEIGHT - 2 - (HEIGHT - 4) * Math.min(v / top, 1);
    d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)} `;
    pen = true;
  }
  return d;
}

function draw(feed, paths) {
  const points = feed.points;
  $("window").textContent = `the last ${Math.round(feed.window_s / 60)} minutes`;
  if (feed.now === null) return;          // no figures yet: the engine has not reported
  for (const [name, card] of Object.entries(CARDS)) {
    const [value, sub] = card.text(feed.now, points);
    $(name + "-value").textContent = value;
    $(name + "-sub").textContent = sub;
    const top = card.top || Math.max(1, ...card.series.map((s) => peak(points, s) || 0));
    card.series.forEach((s, i) => paths[name][i].setAttribute("d", pathData(points, s, top, feed.window_s)));
  }
}

async function poll(paths) {
  try {
    const response = await api("/dashboard.json");
    if (!response.ok) throw new Error(await errorText(response));
    draw(await response.json(), paths);
    setStatus("live");
  } catch (error) {
    setStatus("dashboard: " + error.message);
  }
  setTimeout(() => poll(paths), POLL_MS);
}

// ---- wiring ------------------------------------------------------------------------------------
function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || $("send").disabled) return;     // one answer at a time
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("messages").replaceChildren();
  });
  const paths = {};
  for (const card of document.querySelectorAll(".card")) paths[card.dataset.card] = chart(card);
  loadModels();
  poll(paths);
}

start();
