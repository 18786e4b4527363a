// The edgefl dashboard: reads the server-sent state of one run and draws it. Plain DOM and SVG, no library; every
// value a device sent is set as text, never as markup. Times are the server's wall clock: each message carries the
// server's `now`, and between messages the page counts on from it.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const DASH = "–";
let latest = null; // {now, state}
let receivedAt = 0; // performance.now() when `latest` arrived
let connected = false;
let ended = false; // the dashboard server said it stops (with its run, or its command was stopped): no news will come

function serverNow() {
  return latest ? latest.now + (performance.now() - receivedAt) / 1000 : null;
}

function fmt(value, digits) {
  return value === null || value === undefined ? DASH : Number(value).toFixed(digits);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return DASH;
  const units = ["B", "kB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return DASH;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return m < 60 ? `${m} min ${Math.floor(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

function fmtAgo(t) {
  const now = serverNow();
  if (t === null || t === undefined || now === null) return DASH;
  const ago = Math.max(0, now - t);
  return ago < 1.5 ? "just now" : `${fmtSeconds(ago)} ago`;
}

function fmtCounts(counts) {
  const parts = Object.entries(counts || {}).map(([reason, n]) => `${reason} ${n}`);
  return parts.length ? parts.join(", ") : "0";
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceStep(range) {
  const raw = range / 5;
  const mag = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw);
}

// Accuracy (y) against column `xi` of the points [round, elapsed_s, accuracy], with the target drawn dashed.
function drawChart(el, points, xi, target) {
  const W = 480, H = 260, L = 48, R = 14, T = 12, B = 34;
  el.replaceChildren();
  const xs = points.map((p) => p[xi]);
  const xmin = xi === 0 ? 1 : 0;
  const xmax = Math.max(xmin + 1, ...xs);
  const accs = points.map((p) => p[2]);
  const lows = [...accs, ...(target === null || target === undefined ? [] : [target])];
  const ymin = Math.max(0, Math.floor((Math.min(1, ...lows) - 0.05) * 10) / 10);
  const ymax = 1;
  const x = (v) => L + ((v - xmin) / (xmax - xmin)) * (W - L - R);
  const y = (v) => T + ((ymax - v) / (ymax - ymin)) * (H - T - B);
  const axes = svg("g", { class: "axes" });
  const xstep = xi === 0 ? Math.max(1, Math.round(niceStep(xmax - xmin))) : niceStep(xmax - xmin);
  for (let v = Math.ceil(xmin / xstep) * xstep; v <= xmax + 1e-9; v += xstep) {
    axes.append(svg("line", { x1: x(v), x2: x(v), y1: T, y2: H - B, class: "grid" }));
    axes.append(svg("text", { x: x(v), y: H - B + 16, "text-anchor": "middle" }, String(+v.toFixed(2))));
  }
  const ystep = niceStep(ymax - ymin);
  for (let v = Math.ceil(ymin / ystep) * ystep; v <= ymax + 1e-9; v += ystep) {
    axes.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    axes.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  axes.append(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "label" },
    xi === 0 ? "round" : "seconds"));
  el.append(axes);
  if (target !== null && target !== undefined) {
    el.append(svg("line", { x1: L, x2: W - R, y1: y(target), y2: y(target), class: "target" }));
    el.append(svg("text", { x: W - R - 4, y: y(target) - 5, "text-anchor": "end", class: "target-label" },
      `target ${target.toFixed(2)}`));
  }
  if (!points.length) return;
  el.append(svg("polyline", { points: points.map((p) => `${x(p[xi])},${y(p[2])}`).join(" "), class: "line" }));
  for (const p of points) {
    const dot = svg("circle", { cx: x(p[xi]), cy: y(p[2]), r: points.length > 60 ? 1.8 : 3, class: "point" });
    dot.append(svg("title", {}, `round ${p[0]}: accuracy ${p[2].toFixed(4)} at ${p[1].toFixed(1)} s`));
    el.append(dot);
  }
}

function statusText(s) {
  const run = s.run || {};
  if (run.finished) return `finished: ${s.rounds_done} rounds`;
  if (!run.started_at) return "starting: the server prepares the run";
  if (!run.round) return `waiting for clients: ${s.clients.filter((c) => c.online).length} online`;
  return s.rounds_done >= run.round ? `round ${run.round} done` : `training round ${run.round}`;
}

function elapsed(s) {
  const run = s.run || {};
  if (run.finished || !run.elapsed_origin_at) return s.elapsed_s;
  return serverNow() - run.elapsed_origin_at;
}

function presence(c, finished) {
  if (c.online === null) return DASH;
  if (!c.online) return "offline";
  return finished ? "online at the end" : "online"; // the server stops listening when the run ends
}

function clientCells(c, finished) {
  const last = c.last || {};
  const told = c.told || {};
  const flags = last.throttled;
  const toldText = told.local_steps === undefined ? DASH
    : `τ ${told.local_steps}` + (told.alpha !== undefined && told.alpha !== null ? ` · α ${fmt(told.alpha, 3)}` : "");
  return [
    ["id", c.id],
    ["status", presence(c, finished)],
    ["seen", fmtAgo(c.last_seen)],
    ["class", c.device_class || DASH],
    ["compute", fmt(last.compute_s, 3)],
    ["median", fmt(c.median_compute_s, 3)],
    ["cpu", fmt(last.cpu_s, 3)],
    ["upload", fmt(last.upload_s, 3)],
    ["bytes", fmtBytes(last.bytes_up)],
    ["temp", fmt(last.temperature_c, 1)],
    ["freq", fmt(last.cpu_freq_mhz, 0)],
    ["throttled", flags === null || flags === undefined ? DASH : flags.length ? flags.join(", ") : "none"],
    ["missed", String(c.rounds_missed)],
    ["rejected", fmtCounts(c.rejected)],
    ["told", toldText],
  ];
}

function renderClients(s) {
  const body = document.querySelector("#clients tbody");
  const rows = new Map([...body.rows].map((tr) => [tr.dataset.client, tr]));
  const finished = Boolean(s.run && s.run.finished);
  for (const c of s.clients) {
    let tr = rows.get(c.id);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.client = c.id;
      for (const [key] of clientCells(c, finished)) tr.append(Object.assign(document.createElement("td"), { className: key }));
    }
    body.append(tr); // (re)appended in the server's order: sorted by id
    rows.delete(c.id);
    tr.classList.toggle("online", c.online === true);
    tr.classList.toggle("offline", c.online === false);
    tr.title = c.host ? `host ${c.host}` : "";
    for (const [key, text] of clientCells(c, finished)) tr.querySelector(`td.${key}`).textContent = text;
  }
  for (const tr of rows.values()) tr.remove();
  const online = s.clients.filter((c) => c.online).length;
  setText("devices-count", `${online} of ${s.clients.length} online`);
}

function render() {
  if (!latest) return;
  const s = latest.state;
  const run = s.run || {};
  setText("algorithm", run.algorithm || DASH);
  setText("dataset", run.dataset ? `${run.dataset}${run.partition ? ` (${run.partition})` : ""}` : DASH);
  setText("round", run.rounds ? `${s.rounds_done} of ${run.rounds} done` : String(s.rounds_done));
  setText("elapsed", fmtSeconds(elapsed(s)));
  setText("best", fmt(s.best_accuracy, 4));
  document.getElementById("privacy").hidden = s.epsilon === null || s.epsilon === undefined;
  setText("epsilon", fmt(s.epsilon, 3));
  const target = run.target ?? null;
  const reached = s.reached ? `, reached in round ${s.reached.round} at ${fmtSeconds(s.reached.elapsed_s)}` : "";
  setText("target", target === null ? DASH : `${target.toFixed(2)}${reached}`);
  const stopped = run.finished ? "the run has ended and its dashboard server stopped with it"
    : "the dashboard server stopped";
  const link = ended ? ` · ${stopped}: this page no longer updates`
    : connected ? "" : " (dashboard server not reachable)";
  setText("status", statusText(s) + link);
  drawChart(document.getElementById("chart-rounds"), s.points, 0, target);
  drawChart(document.getElementById("chart-time"), s.points, 1, target);
  renderClients(s);
  setText("rejected-total", `messages rejected in finished rounds, all devices: ${fmtCounts(s.rejected)}`);
  const section = document.getElementById("timeline-section");
  section.hidden = !s.timeline;
  const img = document.getElementById("timeline");
  if (s.timeline && img.dataset.version !== String(s.timeline)) {
    img.dataset.version = String(s.timeline);
    img.src = `/timeline.png?v=${s.timeline}`;
  }
}

function tick() {
  // Between messages only the clocks move: elapsed time and "last seen".
  if (!latest) return;
  setText("elapsed", fmtSeconds(elapsed(latest.state)));
  for (const c of latest.state.clients) {
    const cell = document.querySelector(`#clients tr[data-client="${CSS.escape(c.id)}"] td.seen`);
    if (cell) cell.textContent = fmtAgo(c.last_seen);
  }
}

function connect() {
  const events = new EventSource(`/events${window.location.search}`);
  events.onopen = () => {
    connected = true;
  };
  events.onmessage = (e) => {
    latest = JSON.parse(e.data);
    receivedAt = performance.now();
    connected = true;
    if (latest.ended) {
      ended = true;
      events.close(); // the server is gone: do not retry
    }
    render();
  };
  events.onerror = () => {
    connected = false; // EventSource reconnects by itself
    if (latest) render();
    else setText("status", "dashboard server not reachable; retrying");
  };
}

connect();
setInterval(tick, 1000);
