// llmserve's page: a playground over the OpenAI-compatible API and a live view of /stats/stream.
// Plain browser JavaScript, no dependencies. Model output is only ever inserted as text (textContent),
// never as HTML. The API key lives in this browser's localStorage and goes only into Authorization headers.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "llmserve.apiKey";
const HISTORY = 90; // dashboard points kept (one a second: a minute and a half)

const ui = { mode: "chat", messages: [], controller: null, models: [] };

// ---- API key and models ---------------------------------------------------------------------

function apiHeaders() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function keyNeeded(needed) {
  document.querySelector(".key").classList.toggle("needed", needed);
}

async function loadModels() {
  let body;
  try {
    const r = await fetch("/v1/models", { headers: apiHeaders() });
    keyNeeded(r.status === 401);
    if (!r.ok) return;
    body = await r.json();
  } catch (e) {
    return; // the dashboard's status dot says when the server is unreachable
  }
  const select = $("model");
  const chosen = select.value;
  ui.models = body.data;
  select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  if (body.data.some((m) => m.id === chosen)) select.value = chosen;
  showSamplingDefaults();
}

function showSamplingDefaults() {
  // an empty field samples at the model's default: /v1/models says which value, and who recommends it
  const model = ui.models.find((m) => m.id === $("model").value);
  const d = model && model.sampling_defaults;
  for (const [id, key] of [["temperature", "temperature"], ["top-p", "top_p"]]) {
    $(id).placeholder = d ? `${d[key]} (model's default)` : "model's default";
    $(id).title = d ? `left empty: ${d[key]}, from ${d.source}` : "";
  }
}

function initKey() {
  const input = $("api-key");
  input.value = localStorage.getItem(KEY_STORE) || "";
  let timer;
  input.addEventListener("input", () => {
    const key = input.value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    clearTimeout(timer);
    timer = setTimeout(loadModels, 300);
  });
}

// ---- request body ---------------------------------------------------------------------------

function parseStops(text) {
  // one stop string (\n and \t written out stand for a newline and a tab), or several as a JSON list
  if (text.trim().startsWith("[")) {
    try {
      const list = JSON.parse(text);
      if (Array.isArray(list)) return list.map(String).filter((s) => s.length);
    } catch (e) { /* not a list: taken as one string */ }
  }
  const one = text.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
  return one ? [one] : [];
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function buildBody() {
  const body = {
    model: $("model").value || undefined,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: numberField("max-tokens"),
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    seed: numberField("seed"),
  };
  const stops = parseStops($("stop").value);
  if (stops.length) body.stop = stops;
  if ($("logprobs").checked) {
    if (ui.mode === "chat") Object.assign(body, { logprobs: true, top_logprobs: 5 });
    else body.logprobs = 5;
  }
  const schemaText = $("schema").value.trim();
  $("schema-error").hidden = true;
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      $("schema-error").textContent = "The JSON schema is not valid JSON: " + e.message;
      $("schema-error").hidden = false;
      return null;
    }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: schema } };
  }
  return body;
}

// ---- streaming ------------------------------------------------------------------------------

async function* sseData(response) {
  // server-sent events from a fetch body: yields each event's parsed data until [DONE]
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let m;
    while ((m = /\r?\n\r?\n/.exec(buf))) {
      const event = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(r) {
  try {
    const body = await r.json();
    if (body.error && body.error.message) return `${r.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${r.status} ${r.statusText}`;
}

// one token of the token view: {text, logprob, top: [[text, logprob], ...]}
function chatTokens(lp) {
  return (lp && lp.content || []).map((t) => ({
    text: t.token, logprob: t.logprob, top: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
  }));
}

function completionTokens(lp) {
  if (!lp || !lp.tokens) return [];
  return lp.tokens.map((text, i) => ({
    text, logprob: lp.token_logprobs[i],
    top: Object.entries((lp.top_logprobs || [])[i] || {}),
  }));
}

function tokenSpan(t, extra) {
  // extra: a token with no text in the answer (an end-of-sequence token), shown dimmed
  const span = document.createElement("span");
  span.className = extra ? "tok extra" : "tok";
  span.textContent = t.text;
  const p = Math.exp(t.logprob ?? 0);
  span.style.background = `hsla(${Math.round(120 * p)}, 75%, 50%, ${0.12 + 0.22 * (1 - p)})`;
  span.tokenInfo = t;
  return span;
}

function addMessage(cls, text) {
  $("hint")?.remove();
  const div = document.createElement("div");
  div.className = "msg " + cls;
  if (text !== undefined) div.textContent = text;
  $("transcript").append(div);
  scrollDown();
  return div;
}

function scrollDown() {
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}

function fmtSeconds(s) {
  if (s == null || !isFinite(s)) return "–";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
  return s.toFixed(2) + " s";
}

async function send(ev) {
  ev?.preventDefault();
  if (ui.controller) return;
  const text = $("input").value;
  if (!text.trim()) return;
  const body = buildBody();
  if (!body) return;

  let out;
  let url;
  const mode = ui.mode; // the mode may be switched while this answer streams
  const history = ui.messages; // Clear replaces ui.messages; this answer belongs to the old one
  if (mode === "chat") {
    addMessage("user", text);
    $("input").value = "";
    history.push({ role: "user", content: text });
    const system = $("system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(history);
    url = "/v1/chat/completions";
    out = addMessage("assistant");
  } else {
    body.prompt = text;
    url = "/v1/completions";
    out = addMessage("completion");
    const prompt = document.createElement("span");
    prompt.className = "prompt";
    prompt.textContent = text;
    out.append(prompt);
  }
  const reasoning = document.createElement("span");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const bodyEl = document.createElement("span");
  bodyEl.className = "body";
  const meta = document.createElement("span");
  meta.className = "meta";
  out.append(reasoning, bodyEl, meta);
  out.classList.add("streaming");

  ui.controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let content = "";
  let finish = null;
  let usage = null;
  let tokens = 0;
  try {
    const r = await fetch(url, { method: "POST", headers: apiHeaders(), body: JSON.stringify(body),
                                 signal: ui.controller.signal });
    if (!r.ok) {
      keyNeeded(r.status === 401);
      throw new Error(await errorMessage(r));
    }
    keyNeeded(false);
    for await (const chunk of sseData(r)) {
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const piece = mode === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text || "";
      const thought = mode === "chat" && choice.delta && choice.delta.reasoning_content;
      if (thought) {
        reasoning.hidden = false;
        reasoning.textContent += thought;
      }
      const toks = mode === "chat" ? chatTokens(choice.logprobs) : completionTokens(choice.logprobs);
      if (piece || toks.length) tFirst ??= performance.now();
      content += piece;
      if (toks.length) {
        const extra = !piece && Boolean(choice.finish_reason); // the end-of-sequence token, which adds no text
        bodyEl.append(...toks.map((t) => tokenSpan(t, extra)));
        tokens += toks.length;
      } else if (piece) {
        bodyEl.append(piece);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      scrollDown();
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      out.classList.add("error");
      const err = document.createElement("span");
      err.className = "error-text";
      err.textContent = (content ? "\n" : "") + e.message;
      bodyEl.after(err);
    } else {
      finish = "stopped";
    }
  } finally {
    dimUnsent(bodyEl, content);
    out.classList.remove("streaming");
    const n = usage ? usage.completion_tokens : tokens;
    const secs = (performance.now() - (tFirst ?? t0)) / 1000;
    const parts = [];
    if (n) parts.push(`${n} tokens`);
    if (tFirst != null) parts.push(`first token ${fmtSeconds((tFirst - t0) / 1000)}`);
    if (n > 1 && secs > 0) parts.push(`${((n - 1) / secs).toFixed(1)} tok/s`);
    if (finish) parts.push(finish);
    meta.textContent = parts.join(" · ");
    if (mode === "chat") {
      if (content) history.push({ role: "assistant", content });
      else history.pop(); // nothing came back: the user's turn can be sent again
    }
    ui.controller = null;
    setBusy(false);
  }
}

function dimUnsent(bodyEl, content) {
  // tokens past the answer's text (a matched stop string) are in the token view but not in the answer
  const spans = bodyEl.querySelectorAll(".tok:not(.extra)");
  const all = Array.from(spans, (sp) => sp.textContent).join("");
  if (all.length <= content.length || !all.startsWith(content)) return;
  let at = 0;
  for (const sp of spans) {
    if (at >= content.length) sp.classList.add("extra");
    at += sp.textContent.length;
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-btn").hidden = !busy;
}

function setMode(mode) {
  ui.mode = mode;
  for (const m of ["chat", "completion"]) {
    const b = $("mode-" + m);
    b.classList.toggle("on", m === mode);
    b.setAttribute("aria-selected", String(m === mode));
  }
  $("system-row").hidden = mode !== "chat";
  $("input").placeholder = mode === "chat" ? "Message (Enter to send, Shift+Enter for a new line)"
    : "Prompt to continue (Enter to run, Shift+Enter for a new line)";
}

// ---- token tooltip --------------------------------------------------------------------------

function visible(text) {
  // newlines and control characters shown escaped, spaces as ␣ (" Paris" and "Paris" are different tokens)
  return JSON.stringify(text).slice(1, -1).replace(/ /g, "\u2423");
}

function showTip(ev) {
  const t = ev.target.tokenInfo;
  const tip = $("tip");
  if (!t) {
    tip.hidden = true;
    return;
  }
  const rows = t.top.length ? t.top : [[t.text, t.logprob]];
  const table = document.createElement("table");
  for (const [text, lp] of rows) {
    const tr = table.insertRow();
    if (text === t.text) tr.className = "chosen";
    tr.insertCell().textContent = visible(text);
    const p = tr.insertCell();
    p.className = "p";
    p.textContent = lp == null ? "" : (100 * Math.exp(lp)).toFixed(1) + "%";
  }
  tip.replaceChildren(table);
  tip.hidden = false;
  const x = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 8);
  const y = ev.clientY + 16 + tip.offsetHeight > window.innerHeight ? ev.clientY - tip.offsetHeight - 10 : ev.clientY + 16;
  tip.style.left = Math.max(4, x) + "px";
  tip.style.top = y + "px";
}

// ---- dashboard ------------------------------------------------------------------------------

const hist = { tps: [], running: [], waiting: [], prefill: [], decode: [] };

function push(name, v) {
  hist[name].push(v ?? 0);
  if (hist[name].length > HISTORY) hist[name].shift();
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function drawChart(canvas, series) {
  // series: [[values, cssColorVar], ...], drawn as lines over the last HISTORY points, the first one filled
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (!w) return;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const top = Math.max(1, ...series.flatMap(([v]) => v)) * 1.15;
  // the newest point at the right edge; a fresh page spreads its few points over at least 20 slots
  const span = Math.min(HISTORY, Math.max(20, ...series.map(([v]) => v.length)));
  const x = (i) => w - (span - 1 - i) * (w / (span - 1));
  const y = (v) => h - 2 - (v / top) * (h - 14);
  ctx.lineWidth = 1.6;
  series.forEach(([values, color], k) => {
    if (!values.length) return;
    const off = span - values.length;
    ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(x(off + i), y(v)) : ctx.moveTo(x(off + i), y(v))));
    ctx.strokeStyle = cssVar(color);
    ctx.stroke();
    if (k === 0) {
      ctx.lineTo(x(off + values.length - 1), h);
      ctx.lineTo(x(off), h);
      ctx.closePath();
      ctx.globalAlpha = 0.12;
      ctx.fillStyle = cssVar(color);
      ctx.fill();
      ctx.globalAlpha = 1;
    }
  });
  ctx.fillStyle = cssVar("--muted");
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText((top / 1.15).toFixed(top < 10 ? 1 : 0), 2, 10);
}

function drawCharts() {
  drawChart($("c-tps"), [[hist.tps, "--c1"]]);
  drawChart($("c-batch"), [[hist.running, "--c1"], [hist.waiting, "--c2"]]);
  drawChart($("c-step"), [[hist.decode, "--c1"], [hist.prefill, "--c3"]]);
}

function pct(x) {
  return x == null ? "–" : (100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0) + "%";
}

let frames = 0;

function onFrame(f) {
  frames += 1;
  $("dash-note").dataset.frames = String(frames);
  $("model-name").textContent = f.model + (f.draining ? " · draining" : "");
  $("d-running").textContent = f.running;
  $("d-running-sub").textContent = f.max_num_seqs ? `of ${f.max_num_seqs} sequences` : "sequences";
  $("d-waiting").textContent = f.waiting;
  $("d-tps").textContent = f.output_tok_s == null ? "–" : f.output_tok_s.toFixed(f.output_tok_s < 10 ? 1 : 0);
  $("d-tps-sub").textContent = `${f.output_tokens} tokens since start`;
  $("d-kv").textContent = pct(f.kv_usage);
  $("d-kv-bar").style.width = (100 * f.kv_usage).toFixed(1) + "%";
  $("d-kv-sub").textContent = `${f.kv_used_blocks} of ${f.kv_num_blocks} blocks`;
  $("d-prefix").textContent = f.prefix_caching ? pct(f.prefix_hit_rate) : "off";
  $("d-preempt").textContent = f.preemptions;
  $("d-finished").textContent = `${f.requests_finished} requests finished`;
  for (const k of ["ttft", "itl", "e2e"]) for (const q of ["p50", "p90", "p99"]) $(`${k}-${q}`).textContent = fmtSeconds(f[k][q]);
  if (f.output_tok_s != null) {
    push("tps", f.output_tok_s);
    push("running", f.running);
    push("waiting", f.waiting);
    push("prefill", f.prefill_per_step);
    push("decode", f.decode_per_step);
    drawCharts();
  }
}

function connectStats() {
  const src = new EventSource("/stats/stream");
  src.onopen = () => {
    $("live-dot").className = "dot live";
    $("dash-note").textContent = "live";
    loadModels();
  };
  src.onmessage = (ev) => onFrame(JSON.parse(ev.data));
  src.onerror = () => {
    $("live-dot").className = "dot down";
    $("dash-note").textContent = "reconnecting…"; // EventSource retries by itself
  };
}

// ---- wiring ---------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  initKey();
  setMode("chat");
  if (window.matchMedia("(max-width: 560px)").matches) document.querySelector(".params").open = false;
  $("composer").addEventListener("submit", send);
  $("key-form").addEventListener("submit", (ev) => ev.preventDefault());
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) send(ev);
  });
  $("stop-btn").addEventListener("click", () => ui.controller && ui.controller.abort());
  $("model").addEventListener("change", showSamplingDefaults);
  $("clear").addEventListener("click", () => {
    if (ui.controller) ui.controller.abort();
    ui.messages = [];
    $("transcript").replaceChildren();
  });
  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-completion").addEventListener("click", () => setMode("completion"));
  $("transcript").addEventListener("mouseover", showTip);
  $("transcript").addEventListener("mouseleave", () => ($("tip").hidden = true));
  window.addEventListener("resize", drawCharts);
  loadModels();
  connectStats();
});
