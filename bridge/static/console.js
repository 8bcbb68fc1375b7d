// genserve console: the playground and the live scheduler view. Plain browser JavaScript, no
// build step and no libraries; it talks only to the bridge that served it (same origin).
//   POST   /v1/completions (stream)  -> tokens as they arrive
//   DELETE /v1/requests/{id}         -> the Stop button
//   GET    /v1/console/events        -> scheduler snapshots (server-sent events)
//   GET    /v1/console/replicas      -> every replica's prefix-cache and request counters (polled)
// Both streams are read with fetch(), not EventSource, so that they can carry the API key.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "genserve.apiKey";
const RECONNECT_MS = 2000;
const REPLICAS_POLL_MS = 2000;
const REPLICAS_WINDOW_MS = 60000;     // the window of the "last 60 s" hit ratio

const state = {
  snapshots: 0,          // snapshots received (tests read it)
  last: null,            // the last snapshot
  live: null,            // AbortController of the live stream
  replicas: null,        // the last GET /v1/console/replicas answer (tests read it)
  replicaPolls: [],      // the polls of the last REPLICAS_WINDOW_MS: {t (ms, performance.now()), replicas}
  replicasPoll: null,    // AbortController of the replicas poll loop
  run: null,             // the playground's running request: {controller, requestId, cancelled}
  tab: null,             // the playground's tab (see TABS)
};
window.genserveConsole = state;

// ---- shared: API key, server-sent events over fetch ----------------------------------------

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

// Yields {event, data} for each server-sent event of a fetch() response (data JSON-decoded
// unless it is "[DONE]").
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      let event = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (!data.length) continue;
      const text = data.join("\n");
      yield { event, data: text === "[DONE]" ? text : JSON.parse(text) };
    }
  }
}

// ---- views ---------------------------------------------------------------------------------

function viewOfHash() {
  return location.hash === "#live" ? "live" : "playground";
}

function showView(name) {
  for (const b of document.querySelectorAll("#views button")) b.classList.toggle("active", b.dataset.view === name);
  for (const v of document.querySelectorAll(".view")) v.classList.toggle("active", v.id === `view-${name}`);
  if (name === "live") { startLive(); startReplicas(); } else { stopLive(); stopReplicas(); }
}

// Playground tabs: one per generation endpoint, each with the body it sends and a reader that
// turns one of its stream events into {token: {text, logprob, tokenId, position}} or
// {finish: {reason, detail, timing, usage}} (or null to skip it). "Chat" is offered only when the
// server's OpenAPI description lists /v1/chat/completions.
const COMPLETIONS = {
  name: "Completions",
  path: "/v1/completions",
  label: "Prompt",
  body: (prompt, sampling) => ({ prompt, ...sampling }),
  read: (data) => {
    if (data.finish_reason) return { finish: { reason: data.finish_reason, detail: data.detail, timing: data.timing, usage: data.usage } };
    if (data.token_id === undefined) return null;
    return { token: { text: data.text, logprob: data.logprob, tokenId: data.token_id, position: data.position } };
  },
};
const CHAT = {
  name: "Chat",
  path: "/v1/chat/completions",
  label: "User message",
  body: (prompt, sampling) => {
    const { logprobs, ...rest } = sampling;
    const body = { messages: [{ role: "user", content: prompt }], ...rest };
    if (logprobs !== undefined) Object.assign(body, { logprobs: true, top_logprobs: logprobs });
    return body;
  },
  read: (data) => {
    const choice = (data.choices || [])[0];
    if (!choice) return null;
    if (choice.finish_reason) return { finish: { reason: choice.finish_reason, detail: data.detail, timing: data.timing, usage: data.usage } };
    const delta = choice.delta || {};
    if (delta.role !== undefined || delta.content === undefined) return null;
    const entry = choice.logprobs && choice.logprobs.content ? choice.logprobs.content[0] : undefined;
    return { token: { text: delta.content, logprob: entry ? entry.logprob : undefined } };
  },
};
const TABS = [COMPLETIONS];

async function setUpTabs() {
  try {
    const spec = await (await fetch("/openapi.json")).json();
    if (spec.paths && spec.paths[CHAT.path]) TABS.push(CHAT);
  } catch (_) { /* no description: keep the completions tab */ }
  const nav = $("tabs");
  nav.replaceChildren(...TABS.map((tab) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = tab.name;
    b.dataset.path = tab.path;
    b.addEventListener("click", () => selectTab(tab));
    return b;
  }));
  selectTab(state.tab);
}

function selectTab(tab) {
  if (state.run) return;
  state.tab = tab;
  for (const b of $("tabs").children) b.classList.toggle("active", b.dataset.path === tab.path);
  $("prompt-label").firstChild.textContent = tab.label;
}

// ---- playground ----------------------------------------------------------------------------

function numberField(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

// The sampling fields that are filled in, and stream: true.
function samplingFields() {
  const body = { stream: true };
  const fields = {
    max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top-p", parseFloat),
    top_k: numberField("top-k", (v) => parseInt(v, 10)),
    seed: numberField("seed", (v) => parseInt(v, 10)),
    logprobs: numberField("logprobs", (v) => parseInt(v, 10)),
  };
  for (const [k, v] of Object.entries(fields)) if (v !== undefined && !Number.isNaN(v)) body[k] = v;
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("ignore-eos").checked) body.ignore_eos = true;
  return body;
}

function setRunStatus(text, isError = false) {
  $("run-status").textContent = text;
  $("run-status").classList.toggle("error", isError);
}

function resetStats() {
  for (const id of ["stat-tokens", "stat-ttft", "stat-tpot", "stat-finish", "stat-request-id"]) $(id).textContent = "–";
}

const ms = (v) => (v === undefined || v === null ? "–" : `${v.toFixed(v < 10 ? 1 : 0)} ms`);

function addToken(output, ev, tMs) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = ev.text;
  span.dataset.tMs = tMs.toFixed(1);
  let title = `arrived ${tMs.toFixed(1)} ms after sending`;
  if (ev.tokenId !== undefined) {
    span.dataset.tokenId = ev.tokenId;
    title += ` · token id ${ev.tokenId} · position ${ev.position}`;
  }
  if (ev.logprob !== undefined && ev.logprob !== null) {
    span.dataset.logprob = ev.logprob.toFixed(4);
    title += ` · logprob ${ev.logprob.toFixed(3)} (p ${(Math.exp(ev.logprob) * 100).toFixed(1)} %)`;
    if (ev.logprob < Math.log(0.1)) span.classList.add("low");
  }
  span.title = title;
  output.appendChild(span);
}

async function generate(event) {
  event.preventDefault();
  if (state.run) return;
  const output = $("output");
  output.replaceChildren();
  const prompt = document.createElement("span");
  prompt.className = "prompt";
  prompt.textContent = $("prompt").value;
  output.appendChild(prompt);
  resetStats();
  const run = { controller: new AbortController(), requestId: null, cancelled: false };
  state.run = run;
  $("send").disabled = true;
  $("stop-button").disabled = false;
  setRunStatus("sending…");
  const tab = state.tab;
  const sent = performance.now();
  let tokens = 0;
  let first = null, last = null;     // arrival of the first and last token (ms after sending)
  try {
    const response = await fetch(tab.path, {
      method: "POST", signal: run.controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(tab.body($("prompt").value, samplingFields())),
    });
    if (!response.ok) { setRunStatus(await errorText(response), true); return; }
    run.requestId = response.headers.get("X-Request-Id");
    $("stat-request-id").textContent = run.requestId || "–";
    setRunStatus("streaming…");
    for await (const { event: kind, data } of sseEvents(response)) {
      if (kind === "error") { setRunStatus(`error: ${data.error ? data.error.message : JSON.stringify(data)}`, true); break; }
      if (data === "[DONE]") break;
      const ev = tab.read(data);
      if (ev && ev.finish) {
        // The server's timing when it sends one; else what the browser saw.
        const t = ev.finish.timing || (first === null ? {} : { ttft_ms: first, e2e_ms: last });
        const n = ev.finish.usage ? ev.finish.usage.completion_tokens : tokens;
        $("stat-tokens").textContent = String(n);
        $("stat-ttft").textContent = ms(t.ttft_ms);
        $("stat-tpot").textContent = n > 1 && t.e2e_ms !== undefined ? ms((t.e2e_ms - t.ttft_ms) / (n - 1)) : "–";
        $("stat-finish").textContent = ev.finish.reason + (ev.finish.detail ? ` (${ev.finish.detail})` : "");
        setRunStatus(ev.finish.reason === "cancelled" ? "cancelled" : "done");
      } else if (ev && ev.token) {
        const t = performance.now() - sent;
        if (first === null) first = t;
        last = t;
        tokens += 1;
        addToken(output, ev.token, t);
        $("stat-tokens").textContent = String(tokens);
      }
    }
  } catch (err) {
    if (run.cancelled) setRunStatus("cancelled");
    else setRunStatus(`failed: ${err.message}`, true);
  } finally {
    state.run = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
  }
}

// Stop: DELETE the request (the engine drops it at the next step and the stream ends with
// finish_reason "cancelled"); if that fails, close the stream, which cancels it as well.
async function stop() {
  const run = state.run;
  if (!run) return;
  run.cancelled = true;
  $("stop-button").disabled = true;
  setRunStatus("cancelling…");
  if (run.requestId) {
    try {
      const r = await fetch(`/v1/requests/${encodeURIComponent(run.requestId)}`, { method: "DELETE", headers: authHeaders() });
      if (r.ok) return;
    } catch (_) { /* fall through: disconnect */ }
  }
  run.controller.abort();
}

// ---- live view -----------------------------------------------------------------------------

function stopLive() {
  if (state.live) state.live.abort();
  state.live = null;
}

function setLiveStatus(text, isError = false) {
  $("live-status").textContent = text;
  $("live-status").classList.toggle("error", isError);
}

async function startLive() {
  if (state.live) return;
  const controller = new AbortController();
  state.live = controller;
  while (state.live === controller) {
    try {
      setLiveStatus("connecting…");
      const response = await fetch("/v1/console/events", { headers: authHeaders(), signal: controller.signal });
      if (response.status === 401) {
        // No use retrying with the same key: wait until the API key field changes.
        setLiveStatus(`${await errorText(response)}; enter an API key above`, true);
        state.live = null;
        return;
      }
      if (!response.ok) throw new Error(await errorText(response));
      setLiveStatus("live");
      for await (const { event: kind, data } of sseEvents(response)) {
        if (kind === "error") throw new Error(data.error ? data.error.message : "stream error");
        render(data);
      }
      throw new Error("stream ended");
    } catch (err) {
      if (controller.signal.aborted) return;
      setLiveStatus(`${err.message}; retrying`, true);
      await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
    }
  }
}

function render(s) {
  const prev = state.last;
  state.last = s;
  state.snapshots += 1;
  $("live-engine").textContent = `engine ${s.engine}`;
  $("live-rows").textContent = `${s.running_rows} / ${s.max_rows}`;
  $("live-rows-split").textContent = `${s.prefill_rows} / ${s.decode_rows}`;
  $("live-steps").textContent = String(s.steps);
  $("live-queue-depth").textContent = String(s.queue_depth);
  const share = s.queue_budget_s > 0 ? s.queued_device_s / s.queue_budget_s : 0;
  const bar = $("live-budget-bar");
  bar.style.width = `${Math.min(100, share * 100).toFixed(1)}%`;
  bar.classList.toggle("over", share >= 1);
  $("live-budget").textContent = `${s.queued_device_s.toFixed(2)} s of ${s.queue_budget_s} s budget`;
  renderQueues(s.queues);
  renderAdapters(s.adapters || []);
  renderLatency(s.latency);
  $("live-rejected").textContent = String(s.rejected_total);
  $("live-preemptions").textContent = String(s.preemptions_total);
  $("live-finished").textContent = String(s.finished_total);
  if (prev && prev.engine === s.engine) {
    const time = new Date(s.unix_time_s * 1000).toLocaleTimeString();
    if (s.rejected_total > prev.rejected_total) logEvent(`${time} 429 × ${s.rejected_total - prev.rejected_total}`);
    if (s.preemptions_total > prev.preemptions_total) logEvent(`${time} preemption × ${s.preemptions_total - prev.preemptions_total}`);
  }
  drawSteps(s.recent_steps);
  drawKvMap(s.kv_pool);
}

// A table body holding one row of `columns` cells that says `text` (an empty list's message).
function showEmpty(body, columns, text) {
  const row = body.insertRow();
  body.replaceChildren(row);
  const cell = row.insertCell();
  cell.colSpan = columns;
  cell.textContent = text;
}

function renderQueues(queues) {
  const body = $("live-queues").tBodies[0];
  if (!queues.length) {
    showEmpty(body, 3, "no work");
    return;
  }
  body.replaceChildren(...queues.map((q) => {
    const row = document.createElement("tr");
    for (const v of [q.name, q.queued, q.running]) row.insertCell().textContent = String(v);
    return row;
  }));
}

function renderAdapters(adapters) {
  const body = $("live-adapters").tBodies[0];
  if (!adapters.length) {
    showEmpty(body, 3, "base model only");
    return;
  }
  body.replaceChildren(...adapters.map((a) => {
    const row = document.createElement("tr");
    for (const v of [a.name, a.queued, a.running]) row.insertCell().textContent = String(v);
    return row;
  }));
}

function renderLatency(latency) {
  for (const row of $("live-latency").tBodies[0].rows) {
    const l = latency[row.dataset.key];
    const cells = row.cells;
    const fmt = (v) => (l.count ? ms(v) : "–");
    cells[1].textContent = fmt(l.p50_ms);
    cells[2].textContent = fmt(l.p95_ms);
    cells[3].textContent = fmt(l.max_ms);
    cells[4].textContent = String(l.count);
  }
}

function logEvent(text) {
  const li = document.createElement("li");
  li.textContent = text;
  const list = $("live-events");
  list.prepend(li);
  while (list.children.length > 50) list.lastChild.remove();
}

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// Recent steps: one bar per step, newest at the right; decode ms below prefill ms. Below it,
// the decode rows of each step.
function drawSteps(steps) {
  const canvas = $("steps-chart");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 22;
  ctx.clearRect(0, 0, W, H);
  const slots = 120;
  const bw = (W - pad) / slots;
  const maxMs = Math.max(1, ...steps.map((s) => s.decode_ms + s.prefill_ms));
  const scale = (H - pad) / maxMs;
  steps.forEach((s, i) => {
    const x = pad + (slots - steps.length + i) * bw;
    const hd = s.decode_ms * scale, hp = s.prefill_ms * scale;
    ctx.fillStyle = cssColor("--decode");
    ctx.fillRect(x, H - hd, Math.max(1, bw - 1), hd);
    ctx.fillStyle = cssColor("--prefill");
    ctx.fillRect(x, H - hd - hp, Math.max(1, bw - 1), hp);
  });
  ctx.fillStyle = cssColor("--muted");
  ctx.font = "11px sans-serif";
  ctx.fillText(`${maxMs.toFixed(0)} ms`, 2, 12);
  ctx.fillText(steps.length ? `${steps[steps.length - 1].age_s.toFixed(1)} s ago` : "no steps yet", W - 80, 12);

  const rows = $("rows-chart");
  const rc = rows.getContext("2d");
  rc.clearRect(0, 0, rows.width, rows.height);
  const maxRows = Math.max(1, ...steps.map((s) => s.decode_rows));
  const rs = (rows.height - 14) / maxRows;
  steps.forEach((s, i) => {
    const x = pad + (slots - steps.length + i) * bw;
    rc.fillStyle = cssColor("--accent");
    rc.fillRect(x, rows.height - s.decode_rows * rs, Math.max(1, bw - 1), s.decode_rows * rs);
  });
  rc.fillStyle = cssColor("--muted");
  rc.font = "11px sans-serif";
  rc.fillText(`${maxRows} rows`, 2, 11);
}

// The KV pool as a block map: one cell per block, in block id order.
function drawKvMap(kv) {
  $("kv-summary").textContent =
    `${kv.used} held · ${kv.free} free · ${kv.cached} cached of ${kv.total} blocks (${kv.block_size} tokens each)`;
  const canvas = $("kv-map");
  const W = canvas.width;
  const n = kv.map.length;
  const cols = Math.max(1, Math.ceil(Math.sqrt(n * 6)));
  const cell = Math.max(2, Math.floor(W / cols));
  const perRow = Math.floor(W / cell);
  const height = Math.ceil(n / perRow) * cell;
  if (canvas.height !== height) canvas.height = height;
  const ctx = canvas.getContext("2d");
  const colors = { 0: cssColor("--free"), 1: cssColor("--used"), 2: cssColor("--shared"),
                   3: cssColor("--cached") };
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = colors[kv.map[i]];
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
  }
}

// ---- replicas panel ------------------------------------------------------------------------

// Polls GET /v1/console/replicas every REPLICAS_POLL_MS while the live view is shown. The polls of
// the last REPLICAS_WINDOW_MS are kept, so each replica's hit ratio over that window comes from the
// growth of its counters between them; leaving the view drops them.
async function startReplicas() {
  if (state.replicasPoll) return;
  const controller = new AbortController();
  state.replicasPoll = controller;
  while (state.replicasPoll === controller) {
    try {
      const response = await fetch("/v1/console/replicas", { headers: authHeaders(), signal: controller.signal,
                                                             cache: "no-store" });
      if (!response.ok) throw new Error(await errorText(response));
      const body = await response.json();
      if (state.replicasPoll !== controller) return;
      renderReplicas(body.replicas, performance.now());
      setReplicasStatus("");
    } catch (err) {
      if (controller.signal.aborted) return;
      setReplicasStatus(`${err.message}; retrying`, true);
    }
    await new Promise((resolve) => setTimeout(resolve, REPLICAS_POLL_MS));
  }
}

function stopReplicas() {
  if (state.replicasPoll) state.replicasPoll.abort();
  state.replicasPoll = null;
  state.replicaPolls = [];
}

function setReplicasStatus(text, isError = false) {
  $("replicas-status").textContent = text;
  $("replicas-status").classList.toggle("error", isError);
}

// Hit tokens / queried tokens, or null when nothing was queried.
function hitRatio(hit, queried) {
  return queried > 0 && hit !== null ? hit / queried : null;
}

const percent = (r) => (r === null ? "–" : `${(r * 100).toFixed(1)} %`);

// One replica's hit ratio over the kept polls: the hit and queried tokens added between each two
// of its readable polls in turn (a counter that went down means the engine restarted, and its new
// value is what was added since), null when nothing was queried in the window.
function windowRatio(name) {
  const seen = state.replicaPolls
    .map((p) => p.replicas.find((r) => r.replica === name))
    .filter((r) => r && r.prefix_cache_queried_tokens !== null && r.prefix_cache_hit_tokens !== null);
  let queried = 0, hit = 0;
  for (let i = 1; i < seen.length; i++) {
    const a = seen[i - 1], b = seen[i];
    const restarted = b.prefix_cache_queried_tokens < a.prefix_cache_queried_tokens
      || b.prefix_cache_hit_tokens < a.prefix_cache_hit_tokens;
    queried += b.prefix_cache_queried_tokens - (restarted ? 0 : a.prefix_cache_queried_tokens);
    hit += b.prefix_cache_hit_tokens - (restarted ? 0 : a.prefix_cache_hit_tokens);
  }
  return hitRatio(hit, queried);
}

function renderReplicas(replicas, now) {
  state.replicas = replicas;
  state.replicaPolls.push({ t: now, replicas });
  while (state.replicaPolls.length && state.replicaPolls[0].t < now - REPLICAS_WINDOW_MS) state.replicaPolls.shift();
  const body = $("live-replicas").tBodies[0];
  if (!replicas.length) {
    showEmpty(body, 6, "no engine metrics endpoint configured (the bridge's --engine-metrics-url)");
    return;
  }
  body.replaceChildren(...replicas.map((r) => {
    const row = document.createElement("tr");
    row.dataset.replica = r.replica;
    const show = (v) => (v === null ? "–" : String(v));
    const cells = [r.replica, r.up ? "up" : "down", show(r.running_rows), show(r.requests_finished),
                   percent(r.hit_ratio), percent(windowRatio(r.replica))];
    for (const v of cells) row.insertCell().textContent = v;
    row.cells[1].classList.toggle("down", !r.up);
    if (r.prefix_cache_queried_tokens !== null) {
      row.cells[4].title = `${r.prefix_cache_hit_tokens} of ${r.prefix_cache_queried_tokens} prompt tokens`;
    }
    return row;
  }));
}

// ---- start ---------------------------------------------------------------------------------

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, key.value.trim());
    if (viewOfHash() === "live") { stopLive(); startLive(); }
  });
  // The view is the URL's fragment (#live, #playground), so a view can be linked to.
  for (const b of document.querySelectorAll("#views button")) b.addEventListener("click", () => { location.hash = b.dataset.view; });
  window.addEventListener("hashchange", () => showView(viewOfHash()));
  state.tab = COMPLETIONS;
  $("completion-form").addEventListener("submit", generate);
  $("stop-button").addEventListener("click", stop);
  setUpTabs();
  showView(viewOfHash());
}

init();
