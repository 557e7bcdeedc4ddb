// mlaserve's web page (docs/UI.md). Plain JavaScript, no library: three views over the server's own
// endpoints -- the chat playground (/v1/chat/completions, streamed), the route (/debug/routes, polled)
// and configuration and health (/debug/provenance, /debug/kernels, /debug/verify, /debug/config, /metrics).
"use strict";

const KEY_STORE = "mlaserve-api-key";
const ROUTE_POLL_MS = 1000;
const METRICS_POLL_MS = 2000;
const HEALTH_POLL_MS = 2000;
const ROUTE_RECORDS = 500; // records the route view holds (and asks /debug/routes for)
const CHART_STEPS = 60; // bars drawn
const METRIC_POINTS = 120; // samples per metric plot (4 minutes at 2 s)
const PERCENTILE_WINDOW_S = 30; // TTFT / TPOT percentiles over the last 30 s of observations

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  online: null,
  lastContact: null,
  keyWaiters: [],
  records: new Map(), // "step|rank|spec_phase|draft_depth" -> record
  routesNext: 0, // /debug/routes' number of the next record not seen yet
  debugOff: false,
  selectedStep: null,
  history: [], // chat messages sent so far
  abort: null,
  metrics: {}, // series name -> [[t, value]]
  histSnapshots: [], // [t, {histogram name -> {le -> cumulative count}}]
  configLoaded: false,
  lastSamples: null, // the previous /metrics read: {t, values} (for rates)
  lastTotals: null, // its samples (a plot's "of N" total)
};

// ---- the server: every call carries the key; 401 asks for it once; a failed fetch means the server is gone

function authHeaders(extra) {
  const key = sessionStorage.getItem(KEY_STORE);
  const h = Object.assign({}, extra || {});
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = authHeaders(opts.headers);
  let resp;
  try {
    resp = await fetch(path, opts);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    setOnline(false);
    throw e;
  }
  setOnline(true);
  if (resp.status === 401) {
    await askKey(sessionStorage.getItem(KEY_STORE) ? "The key was refused; enter it again." : "");
    return api(path, options);
  }
  return resp;
}

async function apiJSON(path) {
  const resp = await api(path);
  if (!resp.ok) {
    const err = new Error(path + ": HTTP " + resp.status);
    err.status = resp.status;
    throw err;
  }
  return resp.json();
}

function askKey(message) {
  $("key-message").textContent = message;
  $("key-dialog").hidden = false;
  $("key-input").focus();
  return new Promise((resolve) => state.keyWaiters.push(resolve));
}

function saveKey() {
  const key = $("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("key-dialog").hidden = true;
  $("key-input").value = "";
  const waiters = state.keyWaiters.splice(0);
  waiters.forEach((resolve) => resolve());
}

function setOnline(up, why) {
  const banner = $("banner");
  if (up) {
    state.lastContact = new Date();
    if (state.online === false) {
      banner.textContent = "Reconnected to " + location.origin + ".";
      banner.className = "banner ok";
      setTimeout(() => { if (state.online) banner.hidden = true; }, 3000);
    }
    document.body.classList.remove("offline");
  } else {
    const since = state.lastContact ? " since " + state.lastContact.toLocaleTimeString() : "";
    banner.textContent = (why || "The server at " + location.origin + " is not answering" + since + ".") +
      " Chat, route and metrics are paused; this page tries again every " + HEALTH_POLL_MS / 1000 + " s.";
    banner.className = "banner error";
    banner.hidden = false;
    document.body.classList.add("offline");
  }
  state.online = up;
}

async function pollHealth() {
  try {
    const resp = await fetch("/health", { cache: "no-store" }); // open even under a key
    if (resp.status === 503) setOnline(false, "The server answers but its engine loop is not running (/health: 503).");
    else setOnline(true);
  } catch (e) {
    setOnline(false);
  }
}

// ---- tabs

function showView(name) {
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b.dataset.view === name));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + name; });
  if (name === "config") { loadConfig(); drawMetrics(); }
  if (name === "route") drawRoute();
}

// ---- chat playground

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  box.appendChild(el("div", "role", role));
  const body = el("div", "text", text);
  box.appendChild(body);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return body;
}

function numberSetting(id, parse) {
  const v = $(id).value.trim();
  return v === "" ? undefined : parse(v);
}

function chatRequest() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { model: state.model, messages: messages.concat(state.history), stream: true,
    stream_options: { include_usage: true } };
  const settings = { temperature: parseFloat, top_p: parseFloat, top_k: (v) => parseInt(v, 10),
    max_tokens: (v) => parseInt(v, 10), seed: (v) => parseInt(v, 10) };
  for (const [name, parse] of Object.entries(settings)) {
    const v = numberSetting(name, parse);
    if (v !== undefined) body[name] = v;
  }
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  return body;
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim() || state.abort) return;
  if (!state.model) await loadModel();
  $("chat-input").value = "";
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.parentElement.classList.add("streaming");
  const body = chatRequest();
  $("raw-request").textContent = JSON.stringify(body, null, 2);
  $("raw-response").textContent = "";
  state.abort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, tLast = null, usage = null, answer = "", reasoning = "", finish = null, error = null;
  try {
    const resp = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: state.abort.signal });
    if (!resp.ok) {
      const raw = await resp.text();
      $("raw-response").textContent = "HTTP " + resp.status + "\n" + raw;
      error = errorText(raw, resp.status);
    } else {
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const chunk = decoder.decode(value, { stream: true });
        $("raw-response").textContent += chunk;
        buf += chunk;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const msg = JSON.parse(data);
            if (msg.error) { error = msg.error.message; continue; }
            if (msg.usage) usage = msg.usage;
            for (const choice of msg.choices || []) {
              const delta = choice.delta || {};
              if (delta.content || delta.reasoning_content) {
                if (tFirst === null) tFirst = performance.now();
                tLast = performance.now();
              }
              if (delta.content) answer += delta.content;
              if (delta.reasoning_content) reasoning += delta.reasoning_content;
              if (choice.finish_reason) finish = choice.finish_reason;
              out.textContent = (reasoning ? "[reasoning] " + reasoning + "\n\n" : "") + answer;
            }
          }
        }
      }
    }
  } catch (e) {
    error = e.name === "AbortError" ? "stopped" : "the server went away during the answer (" + e.message + ")";
  }
  out.parentElement.classList.remove("streaming");
  if (error) out.parentElement.appendChild(el("div", "error", "error: " + error));
  if (error && !answer) state.history.pop(); // no answer: the turn is not part of the conversation (send again)
  else state.history.push({ role: "assistant", content: answer });
  out.parentElement.dataset.finish = finish || "";
  showStats(usage, t0, tFirst, tLast, finish);
  state.abort = null;
  $("chat-send").disabled = false;
  $("chat-stop").disabled = true;
}

function errorText(raw, status) {
  try { return JSON.parse(raw).error.message; } catch (e) { return "HTTP " + status; }
}

function showStats(usage, t0, tFirst, tLast, finish) {
  const stats = $("chat-stats");
  const parts = [];
  if (usage) {
    stats.dataset.promptTokens = usage.prompt_tokens;
    stats.dataset.completionTokens = usage.completion_tokens;
    parts.push(usage.prompt_tokens + " prompt tokens", usage.completion_tokens + " completion tokens");
  }
  if (tFirst !== null) parts.push("first token after " + (tFirst - t0).toFixed(0) + " ms");
  if (usage && usage.completion_tokens > 1 && tLast > tFirst) {
    // tokens after the first over the time they took: the decode rate, apart from the prefill
    const rate = (usage.completion_tokens - 1) / ((tLast - tFirst) / 1000);
    parts.push(rate.toFixed(1) + " tokens/s");
  }
  if (finish) parts.push("finish: " + finish);
  stats.textContent = parts.join(" · ");
}

function clearChat() {
  state.history = [];
  $("messages").textContent = "";
  $("chat-stats").textContent = "";
}

async function loadModel() {
  try {
    const models = await apiJSON("/v1/models");
    state.model = models.data[0].id;
    $("model-name").textContent = state.model + " (max_model_len " + models.data[0].max_model_len + ")";
  } catch (e) {
    $("model-name").textContent = "no model information (" + e.message + ")";
  }
}

// ---- the route, live

const PHASE_ORDER = ["decode", "prefill"];
const COLORS = {
  "decode absorbed dense": "#1f77b4",
  "decode absorbed sparse top-k": "#17becf",
  "decode absorbed sparse all rows": "#9edae5",
  "decode decompressed dense": "#aec7e8",
  "prefill decompressed dense": "#ff7f0e",
  "prefill absorbed dense": "#ffbb78",
  "prefill absorbed sparse top-k": "#d62728",
  "prefill absorbed sparse all rows": "#ff9896",
  "prefill decompressed sparse top-k": "#8c564b",
  "decode decompressed sparse top-k": "#c49c94",
};
const SPARE_COLORS = ["#2ca02c", "#98df8a", "#9467bd", "#c5b0d5", "#e377c2", "#7f7f7f", "#bcbd22"];

function colorOf(cat) {
  if (!COLORS[cat]) COLORS[cat] = SPARE_COLORS[Object.keys(COLORS).length % SPARE_COLORS.length];
  return COLORS[cat];
}

function modeOf(rec, seg) {
  // as `mlaserve trace summarize` counts it (observability/summary.py)
  if (!seg.sparse) return "dense";
  return rec.needs_selection ? "sparse top-k" : "sparse all rows";
}

function recordKey(rec) {
  return [rec.step, rec.rank === undefined ? "" : rec.rank, rec.spec_phase || "", rec.draft_depth || ""].join("|");
}

function isTrunk(rec) {
  return !rec.spec_phase || rec.spec_phase === "target" || rec.spec_phase === "verify";
}

async function pollRoutes() {
  if (state.debugOff || state.online === false || !$("key-dialog").hidden) return;
  let out;
  try {
    // only the records written since the last poll (the server numbers them); the first poll: the last 500
    out = await apiJSON("/debug/routes?last=" + ROUTE_RECORDS + "&since=" + state.routesNext);
  } catch (e) {
    if (e.status === 404) debugOff();
    return;
  }
  if (state.debugOff) return; // turned off while this poll was in flight
  if (out.next < state.routesNext) { // numbered from 0 again: the server restarted; start over
    state.records.clear();
    state.routesNext = 0;
    return;
  }
  state.routesNext = out.next;
  if (!out.records.length) return;
  for (const rec of out.records) state.records.set(recordKey(rec), rec);
  const keys = Array.from(state.records.keys());
  for (const k of keys.slice(0, Math.max(0, keys.length - ROUTE_RECORDS))) state.records.delete(k);
  if (!$("view-route").hidden) drawRoute();
}

function debugOff() {
  state.debugOff = true;
  const note = $("route-note");
  note.textContent = "This server runs without --enable-debug-endpoints, so /debug/routes is off: " +
    "restart it with `mlaserve serve --enable-debug-endpoints` to see the route (`--trace FILE` and " +
    "`mlaserve trace plot FILE` draw it offline).";
  note.hidden = false;
  const config = $("config-note");
  config.textContent = "This server runs without --enable-debug-endpoints: the provenance, kernel plan and " +
    "self-checks are off (`mlaserve inspect` prints them). The metrics below come from /metrics, which is always on.";
  config.hidden = false;
}

function trunkByRank() {
  // rank -> step -> record (a single-process ledger has no rank: "")
  const ranks = new Map();
  for (const rec of state.records.values()) {
    if (!isTrunk(rec)) continue;
    const r = rec.rank === undefined ? "" : rec.rank;
    if (!ranks.has(r)) ranks.set(r, new Map());
    ranks.get(r).set(rec.step, rec);
  }
  return ranks;
}

function routeEssentials(rec) {
  // what every rank must agree on for one step (the workers add comm, rank 0 adds requests)
  return JSON.stringify({
    num_tokens: rec.num_tokens, num_decode_tokens: rec.num_decode_tokens, sparse: rec.sparse,
    effective_topk: rec.effective_topk, needs_selection: rec.needs_selection,
    segments: (rec.segments || []).map((s) => [s.phase, s.path, s.sparse, s.num_tokens, s.implementation, s.kind]),
  });
}

function disagreements(ranks) {
  const out = new Set();
  if (ranks.size < 2) return out;
  const [first, ...others] = Array.from(ranks.values());
  for (const [step, rec] of first) {
    for (const other of others) {
      const o = other.get(step);
      if (o && routeEssentials(o) !== routeEssentials(rec)) out.add(step);
    }
  }
  return out;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function drawRoute() {
  const ranks = trunkByRank();
  const rankIds = Array.from(ranks.keys()).sort();
  const main = ranks.get(rankIds[0]) || new Map(); // the chart: rank 0 (every rank runs the same route)
  const steps = Array.from(main.keys()).sort((a, b) => a - b);
  const shown = steps.slice(-CHART_STEPS);
  const disagree = disagreements(ranks);
  $("route-window").textContent = shown.length;

  // totals over every record held (what the test and `trace summarize` count)
  const totals = new Map();
  const phase = { decode: 0, prefill: 0 };
  for (const step of steps) {
    const rec = main.get(step);
    for (const seg of rec.segments || []) {
      const cat = seg.phase + " " + seg.path + " " + modeOf(rec, seg);
      totals.set(cat, (totals.get(cat) || 0) + seg.num_tokens);
      phase[seg.phase] = (phase[seg.phase] || 0) + seg.num_tokens;
    }
  }
  const tbody = $("route-totals").querySelector("tbody");
  tbody.textContent = "";
  for (const cat of Array.from(totals.keys()).sort()) {
    const [ph, path, ...mode] = cat.split(" ");
    const tr = el("tr");
    tr.dataset.phase = ph; tr.dataset.path = path; tr.dataset.mode = mode.join(" ");
    const swatch = el("td"); swatch.appendChild(el("span", "swatch")).style.background = colorOf(cat);
    swatch.appendChild(document.createTextNode(ph));
    tr.append(swatch, el("td", "", path), el("td", "", mode.join(" ")), el("td", "count", String(totals.get(cat))));
    tbody.appendChild(tr);
  }
  $("phase-total-decode").textContent = phase.decode;
  $("phase-total-prefill").textContent = phase.prefill;

  // the stacked bars
  const svg = $("route-chart");
  svg.textContent = "";
  // drawn in pixels (the viewBox is the element's own size): text stays its size at any width
  const W = svg.clientWidth || 900, H = 260, top = 16, bottom = 20, left = 40;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const perStep = shown.map((s) => main.get(s));
  const maxTokens = Math.max(1, ...perStep.map((r) => (r.segments || []).reduce((a, s) => a + s.num_tokens, 0)));
  const bw = (W - left) / Math.max(shown.length, 1);
  const scale = (H - top - bottom) / maxTokens;
  svg.appendChild(svgEl("line", { x1: left, y1: H - bottom, x2: W, y2: H - bottom, class: "axis" }));
  const ytxt = svgEl("text", { x: 2, y: top + 4, class: "axis-label" }); ytxt.textContent = maxTokens;
  svg.appendChild(ytxt);
  if (!shown.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle" });
    t.textContent = state.debugOff ? "route unavailable" : "no step yet: send a chat message";
    svg.appendChild(t);
  }
  shown.forEach((step, i) => {
    const rec = main.get(step);
    const x = left + i * bw;
    let y = H - bottom;
    const g = svgEl("g", { class: "step" + (disagree.has(step) ? " disagree" : "") + (state.selectedStep === step ? " selected" : ""),
      "data-step": step });
    const segs = (rec.segments || []).slice().sort((a, b) => PHASE_ORDER.indexOf(a.phase) - PHASE_ORDER.indexOf(b.phase));
    for (const seg of segs) {
      const cat = seg.phase + " " + seg.path + " " + modeOf(rec, seg);
      const h = seg.num_tokens * scale;
      y -= h;
      const r = svgEl("rect", { x: x + 1, y: y, width: Math.max(bw - 2, 1), height: h, fill: colorOf(cat),
        class: "bar", "data-step": step, "data-phase": seg.phase, "data-category": cat, "data-tokens": seg.num_tokens });
      const tip = svgEl("title");
      tip.textContent = "step " + step + ": " + seg.num_tokens + " tokens " + cat + " (" + seg.implementation +
        (seg.index_scoring ? ", index scoring " + seg.index_scoring : "") + ")";
      r.appendChild(tip);
      g.appendChild(r);
    }
    const hits = (rec.requests || []).filter((q) => q.cached_tokens > 0).length;
    if (hits) g.appendChild(svgEl("circle", { cx: x + bw / 2, cy: y - 5, r: 3, class: "hit" }));
    if ((rec.preempted || []).length) {
      g.appendChild(svgEl("path", { d: `M${x + bw / 2 - 4},${y - 14} l8,0 l-4,7 z`, class: "preempt" }));
    }
    // a transparent column: the whole step is clickable, not only its (maybe 1-pixel) bars
    g.appendChild(svgEl("rect", { x: x, y: top, width: bw, height: H - top - bottom, class: "hitbox", "data-step": step }));
    g.addEventListener("click", () => selectStep(step));
    svg.appendChild(g);
    if (shown.length <= 30 || i % Math.ceil(shown.length / 15) === 0) {
      const t = svgEl("text", { x: x + bw / 2, y: H - 5, class: "axis-label", "text-anchor": "middle" });
      t.textContent = step;
      svg.appendChild(t);
    }
  });
  const legend = $("route-legend");
  legend.textContent = "";
  for (const cat of totals.keys()) {
    const item = el("span", "legend-item");
    item.appendChild(el("span", "swatch")).style.background = colorOf(cat);
    item.appendChild(document.createTextNode(cat));
    legend.appendChild(item);
  }
  legend.appendChild(el("span", "legend-item hit-key", "● prefix-cache hit"));
  legend.appendChild(el("span", "legend-item preempt-key", "▼ preemption"));

  drawCounters(steps.map((s) => main.get(s)));
  drawRanks(ranks, rankIds, disagree);
  if (state.selectedStep !== null) selectStep(state.selectedStep, true);
}

function drawCounters(recs) {
  const requests = new Set();
  let hits = 0, hitTokens = 0, preempt = 0, pages = 0;
  const topk = [];
  const scoring = new Map(); // how selecting segments scored their keys -> tokens
  for (const rec of recs) {
    for (const seg of rec.segments || []) {
      if (seg.index_scoring) scoring.set(seg.index_scoring, (scoring.get(seg.index_scoring) || 0) + seg.num_tokens);
    }
    for (const q of rec.requests || []) {
      requests.add(q.id);
      if (q.cached_tokens > 0) { hits += 1; hitTokens += q.cached_tokens; }
    }
    for (const p of rec.preempted || []) { preempt += 1; pages += p.pages_freed; }
    if (rec.sparse) topk.push([rec.step, rec.effective_topk]);
  }
  let proposed = 0, accepted = 0, drafts = 0;
  const accept = [];
  for (const rec of state.records.values()) {
    if (rec.rank) continue; // rank 0 (or a single process) speaks for the engine
    if (rec.spec_phase === "accept") {
      proposed += rec.num_proposed_tokens; accepted += rec.num_accepted_tokens;
      if (rec.num_proposed_tokens) accept.push([rec.step, rec.num_accepted_tokens / rec.num_proposed_tokens]);
    }
    if (rec.spec_phase === "draft") drafts += 1;
  }
  accept.sort((a, b) => a[0] - b[0]);
  const rows = [
    ["steps", recs.length],
    ["requests", requests.size],
    ["prefix-cache hits", hits + " requests (" + hitTokens + " tokens not recomputed)"],
    ["preemptions", preempt + " (" + pages + " pages freed)"],
    ["effective top-k", topk.length ? topkRange(topk) + " (" + topk.length + " sparse steps)" : "- (no sparse step)"],
    ["index scoring", scoring.size ? Array.from(scoring).map(([k, n]) => k + " (" + n + " tokens)").join(", ") : "- (no step selected)"],
    ["speculative", proposed ? accepted + " / " + proposed + " drafts accepted (" + (100 * accepted / proposed).toFixed(1) + "%), " + drafts + " MTP passes" : "- (no drafts)"],
  ];
  const tbody = $("route-counters").querySelector("tbody");
  tbody.textContent = "";
  for (const [k, v] of rows) {
    const tr = el("tr"); tr.dataset.name = k;
    tr.append(el("th", "", k), el("td", "", String(v)));
    tbody.appendChild(tr);
  }
  sparkline($("topk-chart"), topk.slice(-CHART_STEPS), "no sparse step");
  sparkline($("spec-chart"), accept.slice(-CHART_STEPS), "no speculative step", 1);
}

function topkRange(topk) {
  const ks = topk.map((t) => t[1]);
  const lo = Math.min(...ks), hi = Math.max(...ks);
  return lo === hi ? String(lo) : lo + " to " + hi;
}

function drawRanks(ranks, rankIds, disagree) {
  const panel = $("ranks-panel");
  panel.hidden = rankIds.length < 2;
  if (panel.hidden) return;
  const steps = Array.from(disagree).sort((a, b) => a - b);
  $("ranks-summary").textContent = "ranks " + rankIds.join(", ") + ": " +
    (steps.length ? "records disagree at step(s) " + steps.join(", ") + " (outlined in red)" : "every step's route agrees across ranks");
  $("ranks-summary").className = steps.length ? "error" : "ok-text";
}

function selectStep(step, quiet) {
  state.selectedStep = step;
  const recs = Array.from(state.records.values()).filter((r) => r.step === step);
  $("step-title").textContent = "step " + step + " (" + recs.length + " record" + (recs.length === 1 ? "" : "s") + ")";
  const box = $("step-detail");
  box.textContent = "";
  const trunk = recs.filter(isTrunk);
  const differs = trunk.length > 1 && new Set(trunk.map(routeEssentials)).size > 1;
  for (const rec of recs) {
    const col = el("div", "rank-col" + (differs && isTrunk(rec) ? " disagree" : ""));
    const title = (rec.rank !== undefined ? "rank " + rec.rank + " " : "") + (rec.spec_phase || "step");
    col.appendChild(el("h3", "", title));
    col.appendChild(el("pre", "record", JSON.stringify(rec, null, 1)));
    box.appendChild(col);
  }
  if (!quiet) document.querySelectorAll("#route-chart g.step").forEach((g) =>
    g.classList.toggle("selected", Number(g.dataset.step) === step));
}

function sparkline(svg, points, empty, ymax) {
  svg.textContent = "";
  const W = svg.clientWidth || 300, H = 60, pad = 4;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (!points.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2 + 4, class: "empty", "text-anchor": "middle" });
    t.textContent = empty;
    svg.appendChild(t);
    return;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const top = ymax !== undefined && ymax > 0 ? ymax : Math.max(...ys) > 0 ? Math.max(...ys) : 1;
  const px = (x) => pad + (x1 === x0 ? (W - 2 * pad) / 2 : ((x - x0) / (x1 - x0)) * (W - 2 * pad));
  const py = (y) => H - pad - (y / top) * (H - 2 * pad);
  const d = points.map((p, i) => (i ? "L" : "M") + px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1)).join(" ");
  svg.appendChild(svgEl("path", { d: d, class: "spark-line" }));
  const last = points[points.length - 1];
  svg.appendChild(svgEl("circle", { cx: px(last[0]), cy: py(last[1]), r: 2.5, class: "spark-dot" }));
  const label = svgEl("text", { x: W - pad, y: 12, class: "axis-label", "text-anchor": "end" });
  label.textContent = fmt(last[1]) + " (max " + fmt(top) + ")";
  svg.appendChild(label);
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  if (Math.abs(v) >= 100 || Number.isInteger(v)) return String(Math.round(v));
  return v.toPrecision(3);
}

// ---- configuration and health

async function loadConfig() {
  if (state.configLoaded || state.debugOff) return;
  try {
    const [prov, kernels, verify] = await Promise.all([
      apiJSON("/debug/provenance"), apiJSON("/debug/kernels"), apiJSON("/debug/verify")]);
    state.configLoaded = true;
    drawProvenance(prov);
    drawKernels(kernels);
    drawVerify(verify);
    drawEchoes(prov.ranks || []);
  } catch (e) {
    const note = $("config-note");
    note.textContent = e.status === 404
      ? "This server runs without --enable-debug-endpoints: the provenance, kernel plan and self-checks are " +
        "off (`mlaserve inspect` prints them). The metrics below come from /metrics, which is always on."
      : "Could not read the configuration: " + e.message;
    note.hidden = false;
  }
}

function cell(text, cls) {
  return el("td", cls || "", typeof text === "string" ? text : JSON.stringify(text));
}

function drawProvenance(prov) {
  $("provenance-compared").textContent = "compared with: " + prov.compared_with;
  const tbody = $("provenance").querySelector("tbody");
  tbody.textContent = "";
  for (const row of prov.settings) {
    const tr = el("tr");
    tr.dataset.name = row.name;
    if (row.differs) tr.classList.add("differs");
    tr.append(cell(row.differs ? "≠" : "", "mark"), cell(row.name, "name"), cell(row.value, "value"),
      cell(row.source, "source"), cell("checkpoint" in row ? row.checkpoint : "", "checkpoint"));
    tbody.appendChild(tr);
  }
}

function filterProvenance() {
  const q = $("provenance-filter").value.toLowerCase();
  document.querySelectorAll("#provenance tbody tr").forEach((tr) => {
    tr.hidden = q !== "" && !tr.textContent.toLowerCase().includes(q);
  });
}

function drawKernels(k) {
  $("kernel-digest").textContent = k.digest ? "(plan " + k.digest + ", as every ledger record names it)" : "";
  const tbody = $("kernels").querySelector("tbody");
  tbody.textContent = "";
  for (const r of k.rows) {
    const tr = el("tr");
    tr.append(cell(r.op), cell(r.impl), cell(r.layers), cell(r.reason));
    tbody.appendChild(tr);
  }
  if (!k.rows.length) tbody.appendChild(el("tr")).appendChild(el("td", "muted", "no op with more than one implementation"));
}

function drawVerify(v) {
  const box = $("verify");
  box.textContent = "";
  if (!v.ran) { box.appendChild(el("p", "muted", v.why + " (`mlaserve serve --verify` runs them before serving).")); return; }
  box.appendChild(el("p", v.passed ? "ok-text" : "error", v.passed ? "every check passed" : "a check FAILED"));
  const t = el("table");
  t.appendChild(el("tr")).append(el("th", "", "check"), el("th", "", "max |diff|"), el("th", "", "top-1"), el("th", "", "result"));
  for (const c of v.checks) {
    const tr = el("tr", c.passed ? "" : "differs");
    const verdict = c.tolerance === null ? "info" : (c.passed ? "ok" : "FAIL") + " (tol " + c.tolerance + ")";
    tr.append(cell(c.name), cell(c.max_abs_diff.toExponential(2)), cell((100 * c.top1_agreement).toFixed(1) + "%"), cell(verdict));
    t.appendChild(tr);
  }
  box.appendChild(t);
}

function drawEchoes(ranks) {
  $("tp-panel").hidden = ranks.length < 2;
  if (ranks.length < 2) return;
  const names = Array.from(new Set(ranks.flatMap((r) => Object.keys(r.config || {})))).sort();
  const t = el("table");
  const head = el("tr"); head.appendChild(el("th", "", "field"));
  ranks.forEach((r) => head.appendChild(el("th", "", "rank " + r.rank)));
  t.appendChild(head);
  const rows = [["num_local_heads"], ["vocab_rows"], ["weight_bytes"], ["num_threads"]].map((k) => [k[0], (r) => r[k[0]]])
    .concat(names.map((n) => [n, (r) => (r.config || {})[n]]));
  for (const [name, get] of rows) {
    const tr = el("tr"); tr.appendChild(el("th", "", name));
    const vals = ranks.map(get);
    // per-rank slices (heads, vocabulary rows, bytes, threads) differ by design; a config field must not
    const mustAgree = !["num_local_heads", "vocab_rows", "weight_bytes", "num_threads"].includes(name);
    const differ = mustAgree && new Set(vals.map((v) => JSON.stringify(v))).size > 1;
    vals.forEach((v) => tr.appendChild(cell(v === undefined ? "" : v, differ ? "differs" : "")));
    t.appendChild(tr);
  }
  $("ranks").textContent = "";
  $("ranks").appendChild(t);
}

// /metrics: Prometheus text, parsed here (no client library)
function parseMetrics(text) {
  const samples = {}, hist = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const [, name, labels, value] = m;
    const v = parseFloat(value);
    if (name.endsWith("_bucket")) {
      const le = /le="([^"]+)"/.exec(labels || "");
      const base = name.slice(0, -"_bucket".length);
      (hist[base] = hist[base] || {})[le[1]] = v;
    } else if (!labels) {
      samples[name] = v;
    } else {
      samples[name] = (samples[name] || 0) + v; // a labelled counter: its total
    }
  }
  return { samples, hist };
}

function quantile(q, now, before) {
  // histogram_quantile over the observations between two snapshots: linear inside the bucket
  const les = Object.keys(now).filter((k) => k !== "+Inf").map(parseFloat).sort((a, b) => a - b);
  const count = now["+Inf"] - ((before && before["+Inf"]) || 0);
  if (!(count > 0)) return null;
  const rank = q * count;
  let prevLe = 0, prevCum = 0;
  for (const le of les) {
    const key = Object.keys(now).find((k) => parseFloat(k) === le);
    const cum = now[key] - ((before && before[key]) || 0);
    if (cum >= rank) return prevLe + (le - prevLe) * ((rank - prevCum) / Math.max(cum - prevCum, 1e-12));
    prevLe = le; prevCum = cum;
  }
  return prevLe; // in the +Inf bucket: at least the largest bound
}

const PLOTS = [
  ["running requests", "mlaserve_running_requests"],
  ["queued requests", "mlaserve_queue_depth"],
  ["KV pages in use", "mlaserve_kv_pages_in_use", "mlaserve_kv_pages_total"],
  ["generated tokens/s", "rate:mlaserve_generation_tokens_total"],
  ["TTFT p50 (s)", "p50:mlaserve_time_to_first_token_seconds"],
  ["TTFT p90 (s)", "p90:mlaserve_time_to_first_token_seconds"],
  ["TPOT p50 (s)", "p50:mlaserve_time_per_output_token_seconds"],
  ["TPOT p90 (s)", "p90:mlaserve_time_per_output_token_seconds"],
];

async function pollMetrics() {
  if (state.online === false) return;
  let text;
  try {
    const resp = await api("/metrics");
    if (!resp.ok) return;
    text = await resp.text();
  } catch (e) {
    return;
  }
  const t = Date.now() / 1000;
  const { samples, hist } = parseMetrics(text);
  state.histSnapshots.push([t, hist]);
  while (state.histSnapshots.length > 1 && t - state.histSnapshots[0][0] > PERCENTILE_WINDOW_S) state.histSnapshots.shift();
  const before = state.histSnapshots[0][1];
  const prev = state.lastSamples;
  for (const [, key] of PLOTS) {
    let v = null;
    if (key.startsWith("rate:")) {
      const name = key.slice(5);
      if (prev && samples[name] !== undefined) v = (samples[name] - prev.values[name]) / Math.max(t - prev.t, 1e-3);
    } else if (/^p\d+:/.test(key)) {
      const [q, name] = key.split(":");
      if (hist[name]) v = quantile(parseInt(q.slice(1), 10) / 100, hist[name], before === hist ? null : before[name]);
    } else {
      v = samples[key] === undefined ? null : samples[key];
    }
    const series = (state.metrics[key] = state.metrics[key] || []);
    series.push([t, v]);
    if (series.length > METRIC_POINTS) series.shift();
  }
  state.lastSamples = { t, values: samples };
  state.lastTotals = samples;
  if (!$("view-config").hidden) drawMetrics();
}

function drawMetrics() {
  const box = $("metric-plots");
  if (!box.children.length) {
    for (const [title, key] of PLOTS) {
      const p = el("div", "plot"); p.dataset.key = key;
      p.appendChild(el("div", "plot-title", title));
      p.appendChild(svgEl("svg", { class: "spark", viewBox: "0 0 300 60" }));
      box.appendChild(p);
    }
  }
  for (const [title, key, total] of PLOTS) {
    const p = box.querySelector(`[data-key="${key}"]`);
    const pts = (state.metrics[key] || []).filter((x) => x[1] !== null);
    const top = total && state.lastTotals ? state.lastTotals[total] : undefined;
    sparkline(p.querySelector("svg"), pts, "no data yet", top);
    p.querySelector(".plot-title").textContent = title + (top !== undefined ? " (of " + top + ")" : "");
  }
}

// ---- start

function start() {
  document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => showView(b.dataset.view)));
  $("key-save").addEventListener("click", saveKey);
  $("key-input").addEventListener("keydown", (e) => { if (e.key === "Enter") saveKey(); });
  $("chat-send").addEventListener("click", sendChat);
  $("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendChat(); }
  });
  $("provenance-filter").addEventListener("input", filterProvenance);
  window.addEventListener("resize", () => {
    if (!$("view-route").hidden) drawRoute();
    if (!$("view-config").hidden) drawMetrics();
  });
  boot();
}

async function boot() {
  // what the server says about itself (public): ask for the key before the first call, never call an
  // endpoint that is off
  try {
    const info = await (await fetch("/ui/server.json", { cache: "no-store" })).json();
    if (!info.debug_endpoints) debugOff();
    if (info.api_key && !sessionStorage.getItem(KEY_STORE)) await askKey("");
  } catch (e) {
    setOnline(false);
  }
  const view = location.hash.slice(1); // a link to a view: /#route, /#config
  if (["chat", "route", "config"].includes(view)) showView(view);
  loadModel();
  pollHealth();
  setInterval(pollHealth, HEALTH_POLL_MS);
  pollRoutes();
  setInterval(pollRoutes, ROUTE_POLL_MS);
  pollMetrics();
  setInterval(pollMetrics, METRICS_POLL_MS);
}

start();
