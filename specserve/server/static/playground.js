"use strict";
// The specserve playground. Everything it shows comes from its own server: /v1/models for the
// model list, /v1/chat/completions streamed with the `provenance` extension (each chunk's text
// token by token as [text, source] pairs, and the request's speculation figures so far), and
// /metrics (Prometheus text) polled for the sparklines.

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg"; // an XML namespace name: nothing is fetched from it
const SOURCES = {
  draft: "a draft token the target accepted",
  corrected: "the target's token for a rejected draft",
  bonus: "the target's extra token after a fully accepted draft",
  plain: "a step without drafts",
};

const chat = { messages: [], controller: null };

// ---- requests -------------------------------------------------------------------------------

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// The server's error message from an OpenAI-style error body, or the status line.
async function errorMessage(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    message = (await resp.json()).error.message || message;
  } catch (_) { /* not JSON: keep the status line */ }
  if (resp.status === 401) {
    return "This server needs an API key: type it in the “API key” field at the top. (server: " + message + ")";
  }
  return `The server refused the request (HTTP ${resp.status}): ${message}`;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

async function loadModels() {
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: requestHeaders() });
  } catch (e) {
    return showError("Cannot reach the server: " + e.message);
  }
  if (!resp.ok) return showError(await errorMessage(resp));
  clearError();
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...(await resp.json()).data.map((m) => new Option(m.id, m.id)));
  if (chosen) select.value = chosen;
}

// Server-sent events from a fetch response: yields each event's data (EventSource cannot POST).
async function* sseData(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// Streams one answer to `messages` into `column`; `onChunk(run)` sees the figures after each
// chunk. Resolves to the run: text, tokens, client-measured tokens/s, last speculation figures.
async function streamAnswer(messages, speculative, column, signal, onChunk) {
  const body = {
    model: $("model").value || undefined, messages, stream: true, provenance: true, speculative,
    max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
  };
  const resp = await fetch("/v1/chat/completions",
    { method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal });
  if (!resp.ok) throw new Error(await errorMessage(resp));
  const run = { text: "", tokens: 0, rate: null, spec: null, finish: null, first: null };
  for await (const data of sseData(resp)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error("Generation failed on the server: " + chunk.error.message);
    const choice = chunk.choices[0];
    if (!choice) continue;
    const pieces = choice.provenance || [];
    for (const [text, source] of pieces) column.text.append(tokenSpan(text, source));
    run.text += pieces.map(([text]) => text).join("");
    run.spec = choice.speculation || run.spec;
    run.finish = choice.finish_reason || run.finish;
    if (pieces.length) {
      // tokens/s as the client sees it: tokens after the first chunk over the time since it came
      const now = performance.now();
      if (run.first === null) run.first = { at: now, tokens: pieces.length };
      else run.rate = (run.tokens + pieces.length - run.first.tokens) / ((now - run.first.at) / 1000);
      run.tokens += pieces.length;
    }
    column.stats.textContent = describeRun(run);
    onChunk(run);
  }
  return run;
}

// ---- markdown ---------------------------------------------------------------------------------
// A small renderer for what chat models write: code fences, inline code, bold and italic,
// headings, lists, quotes, rules and links. It builds DOM nodes whose text is set with
// textContent, never HTML, so the model's text cannot inject markup; links keep only the
// http, https and mailto schemes (anything else stays text).

const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);

function safeHref(url) {
  try {
    const parsed = new URL(url);
    return SAFE_SCHEMES.has(parsed.protocol) ? parsed.href : null;
  } catch (_) {
    return null; // relative or malformed: not a link
  }
}

// Inline spans: `code`, **bold**, __bold__, *italic*, _italic_, [text](url).
const INLINE = /(`+)([^`][\s\S]*?)\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

function inlineNodes(text) {
  const nodes = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) nodes.push(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1]) {
      nodes.push(element("code", "", m[2].trim() || m[2]));
    } else if (m[3] !== undefined || m[4] !== undefined) {
      const strong = document.createElement("strong");
      strong.append(...inlineNodes(m[3] ?? m[4]));
      nodes.push(strong);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      const em = document.createElement("em");
      em.append(...inlineNodes(m[5] ?? m[6]));
      nodes.push(em);
    } else {
      const href = safeHref(m[8]);
      if (href === null) {
        nodes.push(document.createTextNode(m[0]));
        continue;
      }
      const a = document.createElement("a");
      a.href = href;
      a.rel = "noopener noreferrer";
      a.target = "_blank";
      a.append(...inlineNodes(m[7]));
      nodes.push(a);
    }
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

// Lines joined by line breaks: a model's single newlines are meant.
function lineNodes(lines) {
  return lines.flatMap((line, i) => (i ? [document.createElement("br")] : []).concat(inlineNodes(line)));
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

// Markdown text -> a DocumentFragment of safe nodes.
function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replaceAll("\r\n", "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) { // a code block, to its closing fence or the end (still streaming)
      const body = [];
      for (i++; i < lines.length && !(lines[i].trim().startsWith(m[1]) && lines[i].trim() === m[1]); i++) {
        body.push(lines[i]);
      }
      i++;
      const pre = document.createElement("pre");
      const code = element("code", m[2] ? "language-" + m[2] : "", body.join("\n"));
      pre.append(code);
      out.append(pre);
    } else if (!line.trim()) {
      i++;
    } else if ((m = line.match(HEADING))) {
      const heading = document.createElement("h" + Math.min(6, m[1].length + 2)); // h3..h6: inside an answer
      heading.append(...inlineNodes(m[2]));
      out.append(heading);
      i++;
    } else if (RULE.test(line)) {
      out.append(document.createElement("hr"));
      i++;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const numbered = !BULLET.test(line);
      const pattern = numbered ? NUMBERED : BULLET;
      const list = document.createElement(numbered ? "ol" : "ul");
      if (numbered && Number(line.match(NUMBERED)[1]) !== 1) list.start = Number(line.match(NUMBERED)[1]);
      for (; i < lines.length && (m = lines[i].match(pattern)); i++) {
        const item = document.createElement("li");
        item.append(...inlineNodes(m[numbered ? 2 : 1]));
        list.append(item);
      }
      out.append(list);
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (m = lines[i].match(QUOTE)); i++) quoted.push(m[1]);
      const quote = document.createElement("blockquote");
      quote.append(...lineNodes(quoted));
      out.append(quote);
    } else { // a paragraph: up to a blank line or the start of another block
      const para = [];
      for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) &&
        !BULLET.test(lines[i]) && !NUMBERED.test(lines[i]) && !QUOTE.test(lines[i]) && !RULE.test(lines[i]); i++) {
        para.push(lines[i]);
      }
      const p = document.createElement("p");
      p.append(...lineNodes(para));
      out.append(p);
    }
  }
  return out;
}

// ---- the conversation -----------------------------------------------------------------------

function tokenSpan(text, source) {
  const span = document.createElement("span");
  span.className = "tok " + source;
  span.title = source + ": " + (SOURCES[source] || "");
  span.textContent = text;
  return span;
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text) el.textContent = text;
  return el;
}

function answerColumn(turn, label) {
  const column = element("div", "answer");
  const head = element("div", "answer-head", label);
  const stats = element("span", "answer-stats");
  const text = element("div", "answer-text");
  const formatted = element("div", "answer-md");
  head.append(stats);
  column.append(head, text, formatted);
  column.dataset.status = "streaming";
  turn.append(column);
  return { root: column, stats, text, formatted };
}

// An answer that has ended also shows as formatted markdown (the "format answers" switch picks
// the view; the token colours stay one click away).
function finishColumn(column, status) {
  column.root.dataset.status = status;
  column.formatted.replaceChildren(renderMarkdown(column.text.textContent));
}

function describeRun(run) {
  const rate = run.rate === null ? "" : ` · ${run.rate.toFixed(1)} tok/s`;
  return ` ${run.tokens} tokens${rate}${run.finish ? " · " + run.finish : ""}`;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "yes" : "no";
}

function resetFigures() {
  for (const id of ["fig-tpp", "fig-tps", "fig-acc", "fig-drafted", "fig-tps-off", "fig-speedup"]) $(id).textContent = "–";
  $("verdict").hidden = true;
  drawBars([]);
}

function showFigures(run) {
  const s = run.spec;
  if (s) {
    $("fig-tpp").textContent = s.mean_accepted_length.toFixed(2);
    $("fig-acc").textContent = s.num_drafted ? percent(s.acceptance_rate) : "nothing drafted";
    $("fig-drafted").textContent = `${s.num_drafted} / ${s.num_accepted}`;
    drawBars(s.acceptance_by_position);
  }
  if (run.rate !== null) $("fig-tps").textContent = run.rate.toFixed(1);
}

function showVerdict(on, off) {
  const verdict = $("verdict");
  if (on.rate && off.rate) $("fig-speedup").textContent = (on.rate / off.rate).toFixed(2) + "×";
  const greedy = Number($("temperature").value) === 0;
  if (on.text === off.text) {
    verdict.className = "verdict same";
    verdict.textContent = "Identical text with speculation on and off" +
      (greedy ? " (greedy): speculation changed the speed, not the answer." : ".");
  } else if (greedy) {
    verdict.className = "verdict differ";
    verdict.textContent = "The texts differ although decoding was greedy: speculation should be lossless here.";
  } else {
    verdict.className = "verdict sampled";
    verdict.textContent = "Sampled (temperature > 0): the two draws may differ; speculation keeps the " +
      "distribution, not the draw. Set temperature 0 to compare texts.";
  }
  verdict.hidden = false;
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || chat.controller) return;
  chat.controller = new AbortController();
  setBusy(true);
  clearError();
  resetFigures();
  if (!$("model").value) await loadModels(); // the key may have been typed since the page loaded
  const system = $("system").value.trim();
  const history = [...chat.messages, { role: "user", content: prompt }];
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const user = element("div", "turn user");
  user.append(element("div", "bubble", prompt));
  const turn = element("div", "turn assistant");
  $("transcript").append(user, turn);
  $("prompt").value = "";
  const on = answerColumn(turn, "speculation on");
  const columns = [on];
  let stage = "on";
  try {
    const onRun = await streamAnswer(messages, true, on, chat.controller.signal, showFigures);
    finishColumn(on, "done");
    chat.messages = [...history, { role: "assistant", content: onRun.text }];
    if ($("compare").checked) {
      stage = "off";
      turn.classList.add("compare");
      const off = answerColumn(turn, "speculation off");
      columns.push(off);
      const offRun = await streamAnswer(messages, false, off, chat.controller.signal, (run) => {
        if (run.rate !== null) $("fig-tps-off").textContent = run.rate.toFixed(1);
      });
      finishColumn(off, "done");
      showVerdict(onRun, offRun);
    }
  } catch (e) {
    const stopped = e.name === "AbortError";
    for (const column of columns.filter((c) => c.root.dataset.status === "streaming")) {
      finishColumn(column, stopped ? "stopped" : "failed");
    }
    if (stage === "on" && !stopped) { // the answer failed: its turn goes, the message back into the box
      user.remove();
      turn.remove();
      $("prompt").value = prompt;
    } else if (stage === "on") {
      chat.messages = [...history, { role: "assistant", content: on.text.textContent }];
    }
    if (!stopped) showError(e.message);
  } finally {
    chat.controller = null;
    setBusy(false);
    turn.scrollIntoView({ block: "end" });
  }
}

// ---- charts ---------------------------------------------------------------------------------

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function percent(x) {
  return (100 * x).toFixed(0) + "%";
}

// Acceptance by draft position: the share of drafts at each depth that the target accepted.
function drawBars(values) {
  const chart = $("by-position");
  const width = 240, height = 90, top = 14, bottom = 16;
  const step = values.length ? Math.min(48, (width - 8) / values.length) : 0;
  const bars = values.flatMap((v, i) => {
    const h = Math.max(1, v * (height - top - bottom));
    const x = 4 + i * step;
    return [
      svg("rect", { class: "bar", x: x + 4, y: height - bottom - h, width: step - 8, height: h }),
      svg("text", { x: x + step / 2, y: height - bottom - h - 3, class: "value" }, percent(v)),
      svg("text", { x: x + step / 2, y: height - 3, class: "axis" }, String(i + 1)),
    ];
  });
  chart.replaceChildren(...(bars.length ? bars : [svg("text", { x: 4, y: 48, class: "empty" }, "no drafts yet")]));
}

// ---- /metrics -------------------------------------------------------------------------------

const SERIES = [
  { label: "generation tokens/s", rate: "specserve_generation_tokens_total",
    help: "rate of specserve_generation_tokens_total (counted as each request ends)", format: (v) => v.toFixed(1) },
  { label: "running requests", metric: "specserve_num_requests_running", format: (v) => v.toFixed(0) },
  { label: "acceptance rate", metric: "specserve_spec_acceptance_rate", format: percent },
  { label: "tokens / target pass", metric: "specserve_spec_mean_accepted_length", format: (v) => v.toFixed(2) },
  { label: "KV cache used", metric: "specserve_kv_cache_usage_ratio", format: percent },
];
const HISTORY = 60; // points kept per series: two minutes at one poll every two seconds
const metrics = { previous: null, points: SERIES.map(() => []) };

// Prometheus text -> Map(name -> value summed over its label sets).
function parseMetrics(text) {
  const sums = new Map();
  for (const line of text.split("\n")) {
    const m = !line.startsWith("#") && line.match(/^([A-Za-z_:][\w:]*)(?:\{.*\})?\s+(\S+)/);
    if (m) sums.set(m[1], (sums.get(m[1]) || 0) + Number(m[2]));
  }
  return sums;
}

function buildSparklines() {
  $("sparklines").replaceChildren(...SERIES.map((s) => {
    const row = element("div", "spark");
    row.title = s.help || s.metric;
    const value = element("span", "spark-value", "–");
    row.append(element("span", "spark-label", s.label),
      svg("svg", { viewBox: "0 0 120 24", preserveAspectRatio: "none", class: "spark-line" }), value);
    return row;
  }));
}

async function pollMetrics() {
  let sums;
  try {
    const resp = await fetch("/metrics");
    if (!resp.ok) return;
    sums = { at: performance.now(), values: parseMetrics(await resp.text()) };
  } catch (_) {
    return; // the server is away; the lines resume when it answers again
  }
  const previous = metrics.previous;
  metrics.previous = sums;
  SERIES.forEach((s, i) => {
    let v;
    if (s.rate) {
      if (!previous) return;
      v = Math.max(0, (sums.values.get(s.rate) || 0) - (previous.values.get(s.rate) || 0)) /
        ((sums.at - previous.at) / 1000);
    } else {
      v = sums.values.get(s.metric);
      if (v === undefined) return;
    }
    const points = metrics.points[i];
    points.push(v);
    if (points.length > HISTORY) points.shift();
    drawSparkline($("sparklines").children[i], points, s.format(v));
  });
}

function drawSparkline(row, points, label) {
  const line = row.querySelector("svg");
  const top = Math.max(...points) || 1;
  const xy = points.map((v, i) => `${(i * 120) / Math.max(1, points.length - 1)},${(22 - (20 * v) / top).toFixed(1)}`);
  line.replaceChildren(svg("polyline", { points: xy.join(" "), class: "line" }));
  row.querySelector(".spark-value").textContent = label;
}

// ---- wiring ---------------------------------------------------------------------------------

function start() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("clear").addEventListener("click", () => {
    chat.messages = [];
    $("transcript").replaceChildren();
    resetFigures();
    clearError();
  });
  $("api-key").addEventListener("change", loadModels);
  const showFormatted = () => { document.body.dataset.view = $("markdown").checked ? "formatted" : "tokens"; };
  $("markdown").addEventListener("change", showFormatted);
  showFormatted();
  setBusy(false);
  resetFigures();
  buildSparklines();
  loadModels();
  pollMetrics();
  setInterval(pollMetrics, 2000);
}

start();
