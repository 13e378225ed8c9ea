"""The dashboard page: one self-contained HTML document (inline CSS, JS and SVG, no CDN).

The script asks the serving process for ``api/v1/query_range`` (proxied to Prometheus, so no
CORS) every few seconds and draws one SVG line chart per panel. Each chart's ``<svg>`` carries
``data-points`` (samples drawn) and ``data-series`` (lines drawn), and each panel
``data-state`` (``loading``, ``ok``, ``empty`` or ``error``), for tests and for curious users.
Panels are PromQL over the metrics of :mod:`gasloc_p2p.node.observability.metrics`.
"""

from __future__ import annotations

from gasloc_p2p.tools.direct_metrics import Recipe

# (title, PromQL, unit shown on the axis, legend label key)
PANELS: tuple[tuple[str, str, str, str], ...] = (
    ("Validation loss per node", "gasloc_val_loss", "nats/token", "node"),
    ("Training throughput per node", "gasloc_tokens_per_second", "tokens/s", "node"),
    ("Exchanges per second by outcome",
     "sum by (outcome) (rate(gasloc_exchanges_total[30s]))", "1/s", "outcome"),
    ("Payload bytes sent per second per node",
     "sum by (node) (rate(gasloc_sent_bytes_total[30s]))", "B/s", "node"),
    ("Consensus estimate per node", "gasloc_consensus_estimate",
     "EMA of ||p_i - p_j||^2 / numel", "node"),
    ("Exchange duration p50 / p95", 'label_replace(histogram_quantile(0.5, sum by (le) '
     '(rate(gasloc_exchange_duration_seconds_bucket[1m]))), "q", "p50", "", "") or '
     'label_replace(histogram_quantile(0.95, sum by (le) '
     '(rate(gasloc_exchange_duration_seconds_bucket[1m]))), "q", "p95", "", "")', "s", "q"),
)

# When the swarm started: its oldest live node's process start (prometheus_client's
# ProcessCollector, on every node; `and on (instance) gasloc_info` keeps only gasloc nodes).
# The page opens on the window from there to now ("since start").
START_QUERY = "min(process_start_time_seconds and on (instance) gasloc_info)"
MIN_RANGE_S, MAX_RANGE_S = 60, 21600  # "since start" shows at least a minute, at most 6 h

# What each panel's query computes, for the dashboard without Prometheus (direct_metrics).
RECIPES: dict[str, Recipe] = {
    PANELS[0][1]: Recipe("gauge", "gasloc_val_loss"),
    PANELS[1][1]: Recipe("gauge", "gasloc_tokens_per_second"),
    PANELS[2][1]: Recipe("rate", "gasloc_exchanges_total", by="outcome", window_s=30),
    PANELS[3][1]: Recipe("rate", "gasloc_sent_bytes_total", by="node", window_s=30),
    PANELS[4][1]: Recipe("gauge", "gasloc_consensus_estimate"),
    PANELS[5][1]: Recipe("quantiles", "gasloc_exchange_duration_seconds_bucket", window_s=60,
                         quantiles=(0.5, 0.95)),
}

_STYLE = """
body { font: 13px system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #222; }
header { display: flex; gap: 16px; align-items: baseline; padding: 10px 16px;
         background: #1f2937; color: #f9fafb; }
header h1 { font-size: 16px; margin: 0; }
header .status { color: #cbd5e1; }
header button { background: #374151; color: #f9fafb; border: 1px solid #4b5563;
                border-radius: 3px; padding: 2px 8px; cursor: pointer; }
header button.on { background: #2563eb; }
main { display: grid; grid-template-columns: repeat(2, 1fr); gap: 8px; padding: 8px; }
.panel { background: #fff; border: 1px solid #d1d5db; border-radius: 4px; padding: 6px 8px; }
.panel h2 { font-size: 13px; margin: 0 0 2px 0; font-weight: 600; }
.panel h2 small { color: #6b7280; font-weight: 400; }
.panel .msg { color: #6b7280; font-size: 12px; height: 14px; }
.legend { font-size: 11px; display: flex; flex-wrap: wrap; gap: 10px; min-height: 14px; }
.legend span::before { content: ""; display: inline-block; width: 10px; height: 3px;
                       margin-right: 4px; vertical-align: middle; background: var(--c); }
svg text { font-size: 10px; fill: #4b5563; }
svg .grid { stroke: #e5e7eb; }
svg .axis { stroke: #9ca3af; }
"""

_SCRIPT = r"""
const PANELS = __PANELS__, START_QUERY = __START_QUERY__;
const MIN_RANGE_S = __MIN_RANGE_S__, MAX_RANGE_S = __MAX_RANGE_S__, FALLBACK_RANGE_S = 900;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2",
                "#db2777", "#65a30d", "#4b5563", "#ea580c"];
const W = 600, H = 190, L = 58, R = 10, T = 8, B = 20;
let rangeS = null;  // null: "since start", from the swarm's oldest node to now

function fmt(v) {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return v.toPrecision(2);
}

function el(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}

function draw(panel, result, start, end) {
  const svg = panel.querySelector("svg"), legend = panel.querySelector(".legend");
  svg.replaceChildren(); legend.replaceChildren();
  const series = result.map(s => ({
    label: s.metric[panel.dataset.key] || s.metric.instance || "value",
    pts: s.values.map(([t, v]) => [Number(t), Number(v)]).filter(p => isFinite(p[1])),
  })).filter(s => s.pts.length > 0).sort((a, b) => a.label.localeCompare(b.label));
  const n = series.reduce((acc, s) => acc + s.pts.length, 0);
  svg.setAttribute("data-points", n);
  svg.setAttribute("data-series", series.length);
  if (n === 0) { panel.dataset.state = "empty"; panel.querySelector(".msg").textContent =
    "no data yet"; return; }
  panel.dataset.state = "ok";
  panel.querySelector(".msg").textContent = "";
  let lo = Infinity, hi = -Infinity;
  for (const s of series) for (const [, v] of s.pts) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (hi - lo < 1e-12) { hi += Math.abs(hi) * 0.05 + 1e-9; lo -= Math.abs(lo) * 0.05 + 1e-9; }
  const pad = (hi - lo) * 0.05, nonNegative = lo >= 0;
  lo -= pad; hi += pad;
  if (nonNegative) lo = Math.max(lo, 0);  // rates and counts: no negative axis
  const x = t => L + (t - start) / (end - start) * (W - L - R);
  const y = v => T + (hi - v) / (hi - lo) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = lo + (hi - lo) * i / 4, yy = y(v);
    svg.appendChild(el("line", {x1: L, x2: W - R, y1: yy, y2: yy, class: "grid"}));
    svg.appendChild(el("text", {x: L - 4, y: yy + 3, "text-anchor": "end"}, fmt(v)));
  }
  for (let i = 0; i <= 4; i++) {
    const t = start + (end - start) * i / 4;
    const label = new Date(t * 1000).toTimeString().slice(0, 8);
    svg.appendChild(el("text", {x: x(t), y: H - 6, "text-anchor": i === 0 ? "start" :
      i === 4 ? "end" : "middle"}, label));
  }
  svg.appendChild(el("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
  series.forEach((s, i) => {
    const c = COLORS[i % COLORS.length];
    const d = s.pts.map(([t, v], j) => (j ? "L" : "M") + x(t).toFixed(1) + "," + y(v).toFixed(1))
      .join("");
    svg.appendChild(el("path", {d, fill: "none", stroke: c, "stroke-width": 1.6,
      "data-label": s.label, "data-points": s.pts.length}));
    if (s.pts.length === 1) {
      const [t, v] = s.pts[0];
      svg.appendChild(el("circle", {cx: x(t), cy: y(v), r: 2.5, fill: c}));
    }
    const item = document.createElement("span");
    item.style.setProperty("--c", c);
    item.textContent = s.label + " " + fmt(s.pts[s.pts.length - 1][1]);
    legend.appendChild(item);
  });
}

async function refreshPanel(panel, start, end, step) {
  const q = new URLSearchParams({query: panel.dataset.query, start: start.toFixed(3),
                                 end: end.toFixed(3), step: String(step)});
  try {
    const reply = await fetch("api/v1/query_range?" + q);
    const body = await reply.json();
    if (body.status !== "success") throw new Error(body.error || reply.statusText);
    draw(panel, body.data.result, start, end);
  } catch (err) {
    panel.dataset.state = "error";
    panel.querySelector(".msg").textContent = "error: " + err.message;
  }
}

async function refreshStatus() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("api/v1/query?" + new URLSearchParams({query: "up"}));
    const body = await reply.json();
    const up = body.data.result.filter(s => s.value[1] === "1").length;
    status.textContent = `${up}/${body.data.result.length} nodes up · updated ` +
      new Date().toTimeString().slice(0, 8);
    status.dataset.up = up;
  } catch (err) {
    status.textContent = "Prometheus unreachable: " + err.message;
  }
}

async function sinceStart(end) {
  // the window from the swarm's start (a young swarm fills the charts, not their right edge)
  try {
    const reply = await fetch("api/v1/query?" + new URLSearchParams({query: START_QUERY}));
    const body = await reply.json();
    const t0 = Number(body.data.result[0].value[1]);
    if (!isFinite(t0) || t0 <= 0) throw new Error("no start time");
    return Math.min(MAX_RANGE_S, Math.max(MIN_RANGE_S, Math.ceil((end - t0) * 1.02 + 5)));
  } catch (err) {
    return FALLBACK_RANGE_S;  // no node answers yet: the last 15 minutes
  }
}

async function refresh() {
  const end = Date.now() / 1000;
  const span = rangeS === null ? await sinceStart(end) : rangeS, start = end - span;
  const step = Math.max(1, Math.round(span / 300));
  Object.assign(document.body.dataset, {range: span, start: start.toFixed(3)});
  await Promise.all([refreshStatus(), ...Array.from(document.querySelectorAll(".panel"),
                     p => refreshPanel(p, start, end, step))]);
  document.body.dataset.refreshes = Number(document.body.dataset.refreshes || 0) + 1;
}

function setup() {
  const main = document.querySelector("main");
  for (const [title, query, unit, key] of PANELS) {
    const panel = document.createElement("section");
    panel.className = "panel";
    Object.assign(panel.dataset, {query, unit, key, state: "loading"});
    panel.innerHTML = "<h2><span></span> <small></small></h2><div class='legend'></div>" +
      "<div class='msg'>loading</div>";
    panel.querySelector("h2 span").textContent = title;
    panel.querySelector("h2 small").textContent = unit ? "(" + unit + ")" : "";
    panel.querySelector("h2").title = query;
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", "data-points": 0});
    panel.insertBefore(svg, panel.querySelector(".msg"));
    main.appendChild(panel);
  }
  for (const b of document.querySelectorAll("header button")) {
    b.onclick = () => {
      rangeS = b.dataset.range === "start" ? null : Number(b.dataset.range);
      document.querySelectorAll("header button").forEach(o => o.classList.toggle("on", o === b));
      refresh();
    };
  }
  const params = new URLSearchParams(location.search);
  if (params.has("range")) rangeS = Number(params.get("range"));
  document.querySelectorAll("header button").forEach(o => o.classList.toggle("on",
    rangeS === null ? o.dataset.range === "start" : Number(o.dataset.range) === rangeS));
  refresh();
  setInterval(refresh, Number(params.get("refresh") || 5) * 1000);
}
window.addEventListener("DOMContentLoaded", setup);
"""


def render_page(title: str = "gasloc swarm") -> str:
    """The dashboard HTML (self-contained)."""
    import html
    import json

    panels = json.dumps([list(p) for p in PANELS])
    buttons = "".join(f'<button data-range="{s}">{label}</button>' for s, label in
                      (("start", "since start"), (300, "5 min"), (900, "15 min"),
                       (3600, "1 h"), (21600, "6 h")))
    script = (_SCRIPT.replace("__PANELS__", panels)
              .replace("__START_QUERY__", json.dumps(START_QUERY))
              .replace("__MIN_RANGE_S__", str(MIN_RANGE_S))
              .replace("__MAX_RANGE_S__", str(MAX_RANGE_S)))
    return ("<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<header><h1>{html.escape(title)}</h1>{buttons}"
            "<span class=status id=status>connecting</span></header><main></main>"
            f"<script>{script}</script></body></html>\n")
