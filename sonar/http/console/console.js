// Sonar's web console: polls /actors and /metrics, draws the tree and the charts, and streams a
// chat from /v1/chat/completions. Every URL is relative, so the page works under --root-path.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120; // points kept per chart: two minutes at one poll a second
const MIN_WIDTH = 30; // points a chart's window spans at least
const KEY_STORE = "sonar-api-key";
const SVG = "http://www.w3.org/2000/svg";

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  needKey: false,
  model: null,
  lastGen: null, // {tokens, at}: the previous scrape's generation token count
  series: { throughput: [], kv: [], running: [], waiting: [] },
  chat: [], // the conversation sent with each request
  busy: false,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new Unauthorized(await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `${response.status} ${text.slice(0, 200)}`;
  }
}

// --- Prometheus text ------------------------------------------------------------------------

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

/** The samples of a Prometheus text exposition: [{name, labels, value}]. */
function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = SAMPLE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, key, value] of (m[3] || "").matchAll(LABEL)) labels[key] = value;
    samples.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return samples;
}

/** The values of metric `name` (one per series; several with data-parallel replicas). */
function values(samples, name) {
  return samples.filter((s) => s.name === name).map((s) => s.value);
}

const sum = (xs) => xs.reduce((a, b) => a + b, 0);

function record(samples, at) {
  const gen = sum(values(samples, "sonar:generation_tokens_total"));
  if (state.lastGen !== null && at > state.lastGen.at) {
    const rate = Math.max(0, gen - state.lastGen.tokens) / ((at - state.lastGen.at) / 1000);
    push(state.series.throughput, rate);
  }
  state.lastGen = { tokens: gen, at };
  const kv = values(samples, "sonar:kv_cache_usage_perc");
  push(state.series.kv, kv.length ? (100 * sum(kv)) / kv.length : 0);
  push(state.series.running, sum(values(samples, "sonar:num_requests_running")));
  push(state.series.waiting, sum(values(samples, "sonar:num_requests_waiting")));
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

// --- charts ---------------------------------------------------------------------------------

function drawChart(id, lines, label) {
  const box = $(id);
  if (!box.firstChild) {
    const head = el("div", { class: "chart-head" }, el("span", {}, box.dataset.title), el("span", { class: "chart-value" }));
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("preserveAspectRatio", "none");
    lines.forEach((_, i) => {
      const line = document.createElementNS(SVG, "polyline");
      if (i > 0) line.setAttribute("class", "second");
      svg.append(line);
    });
    box.append(head, svg);
  }
  const top = Number(box.dataset.max) || Math.max(1, ...lines.flat()) * 1.1;
  // The window widens with the history up to HISTORY points, so a new page's lines are not slivers.
  const width = Math.max(MIN_WIDTH, ...lines.map((series) => series.length));
  box.querySelector("svg").setAttribute("viewBox", `0 0 ${width - 1} 100`);
  const polylines = box.querySelectorAll("polyline");
  lines.forEach((series, i) => {
    const offset = width - series.length;
    const points = series.map((v, x) => `${x + offset},${(100 - (100 * v) / top).toFixed(2)}`);
    polylines[i].setAttribute("points", points.join(" "));
  });
  box.dataset.points = String(lines[0].length);
  box.querySelector(".chart-value").textContent = label;
}

function drawCharts() {
  const { throughput, kv, running, waiting } = state.series;
  const last = (xs) => (xs.length ? xs[xs.length - 1] : 0);
  drawChart("chart-throughput", [throughput], `${last(throughput).toFixed(1)} ${$("chart-throughput").dataset.unit}`);
  drawChart("chart-kv", [kv], `${last(kv).toFixed(1)} %`);
  drawChart("chart-queue", [running, waiting], `${last(running)} running / ${last(waiting)} waiting`);
}

// --- the supervision tree and its restarts ----------------------------------------------------

function treeNode(node, path) {
  const name = path ? `${path}/${node.name}` : node.name;
  const facts = [node.kind, node.placement];
  if (node.pid !== null) facts.push(`pid ${node.pid}`);
  if (node.mailbox_depth !== null) facts.push(`mailbox ${node.mailbox_depth}`);
  if (node.restarts) facts.push(`${node.restarts} restart${node.restarts === 1 ? "" : "s"}`);
  const item = el(
    "li",
    { "data-actor": node.name, "data-state": node.state },
    el("span", { class: "node-name" }, node.name),
    " ",
    el("span", { class: `state state-${node.state}` }, node.state),
    " ",
    el("span", { class: "muted" }, facts.join(" · ")),
  );
  if (node.children.length) {
    item.append(el("ul", {}, ...node.children.map((child) => treeNode(child, name))));
  }
  return item;
}

/** Every node that restarted, newest restart first (`started_at`: when its current run began). */
function restarted(node, path = "", out = []) {
  const name = path ? `${path}/${node.name}` : node.name;
  if (node.restarts > 0) out.push({ name, node });
  for (const child of node.children) restarted(child, name, out);
  return out.sort((a, b) => (b.node.started_at || 0) - (a.node.started_at || 0));
}

function drawTree(root) {
  $("tree").replaceChildren(treeNode(root, ""));
  const items = restarted(root).map(({ name, node }) => {
    const when = node.started_at ? new Date(node.started_at * 1000).toLocaleTimeString() : "?";
    const why = node.last_exit ? ` — ${node.last_exit}` : "";
    return el("li", { "data-actor": name }, el("b", {}, name), ` restarted ×${node.restarts}, running since ${when}${why}`);
  });
  $("restarts").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "none")]));
}

// --- polling --------------------------------------------------------------------------------

function askForKey(message) {
  state.needKey = true;
  $("key-form").hidden = false;
  $("key-error").textContent = state.key ? message : "";
  $("status").textContent = "API key required";
}

async function poll() {
  if (state.needKey) return;
  try {
    if (state.model === null) {
      const models = await (await api("v1/models")).json();
      state.model = models.data.length ? models.data[0].id : "";
      $("model").textContent = state.model;
    }
    const [actors, metrics] = await Promise.all([api("actors"), api("metrics")]);
    if (!actors.ok) throw new Error(`/actors: ${await errorMessage(actors)}`);
    if (!metrics.ok) throw new Error(`/metrics: ${await errorMessage(metrics)}`);
    drawTree(await actors.json());
    record(parsePrometheus(await metrics.text()), Date.now());
    drawCharts();
    $("status").textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    if (err instanceof Unauthorized) askForKey(err.message);
    else $("status").textContent = `unreachable: ${err.message}`;
  }
}

// --- chat -------------------------------------------------------------------------------------

function addMessage(role, text) {
  const body = el("span", { class: "content" }, text);
  const item = el("div", { class: `message ${role}` }, el("span", { class: "role" }, role), body);
  $("chat-log").append(item);
  return { item, body };
}

/** The `data:` payloads of the SSE stream in `response`, as they arrive. */
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  state.busy = true;
  $("chat-send").disabled = true;
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  const { item, body } = addMessage("assistant", "");
  item.dataset.state = "streaming";
  let answer = "";
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: state.model || undefined,
        messages: state.chat,
        stream: true,
        max_tokens: Number($("max-tokens").value),
        temperature: Number($("temperature").value),
      }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        answer += delta.content;
        body.textContent = answer;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    }
    state.chat.push({ role: "assistant", content: answer });
    item.dataset.state = "done";
  } catch (err) {
    if (err instanceof Unauthorized) askForKey(err.message);
    state.chat.pop(); // the question without an answer is not sent again
    item.classList.add("error");
    body.textContent = `${answer}${answer ? "\n" : ""}error: ${err.message}`;
    item.dataset.state = "error";
  } finally {
    state.busy = false;
    $("chat-send").disabled = false;
  }
}

// --- start ------------------------------------------------------------------------------------

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.key);
    state.needKey = false;
    $("key-form").hidden = true;
    poll();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || state.busy) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-clear").addEventListener("click", () => {
    state.chat = [];
    $("chat-log").replaceChildren();
  });
  poll();
  setInterval(poll, POLL_MS);
}

start();
