// One chart of the live metrics widget: axes (with the x axis named, and a final tick at the
// last step), curves (raw and smoothed), markers for sparse series, the best point, epoch
// lines, the legend and the crosshair read-out. Pure drawing: the panel (widget.js) owns the
// data and the reader's settings and redraws a chart when they change.
//
// The legend says what each number is, in the words of the static copy (static.py's
// legend_text): "loss: last 0.139 · smoothed 0.0812 · min 0.00655" -- the last logged value,
// the smoothed curve's last value where one is drawn, the lowest (or highest) logged value.

const SVG_NS = "http://www.w3.org/2000/svg";
// CHART_HEIGHT: with a one-line legend; each further legend line adds LEGEND_LINE.
const CHART_HEIGHT = 172, PAD_LEFT = 52, PAD_RIGHT = 12, PAD_TOP = 24, PAD_BOTTOM = 34;
const LEGEND_LINE = 13, TOGGLES_WIDTH = 140; // the log/per-rank toggles sit over the top right
const FINAL_TICK_GAP = 40; // px: a nice tick this close to the final tick is left out
const RANK_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
const FONT = "system-ui, sans-serif";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

let measureCtx = null;
// The width of `text` in px, in the SVG's font (the SVG need not be in the page yet).
function textWidth(text, size = 10, weight = "normal") {
  measureCtx ??= document.createElement("canvas").getContext("2d");
  measureCtx.font = `${weight} ${size}px ${FONT}`;
  return measureCtx.measureText(text).width;
}

// One series' legend entry (the same words as static.py's legend_text).
function legendText(name, last, smoothed, best, extreme) {
  const parts = [`last ${number(last)}`];
  if (smoothed !== null && smoothed !== undefined) parts.push(`smoothed ${number(smoothed)}`);
  if (best && extreme !== null && extreme !== undefined) parts.push(`${best} ${number(extreme)}`);
  return `${name}: ${parts.join(" · ")}`;
}

// Nice ticks over [lo, hi] plus a final one at `last` (the last step drawn), leaving out the
// nice ticks closer than FINAL_TICK_GAP px to it.
function xTicks(lo, hi, last, target, pxPerUnit, opts) {
  const ticks = niceTicks(lo, hi, target, opts);
  if (!(last >= lo && last <= hi) || ticks.includes(last)) return ticks;
  return [...ticks.filter((t) => Math.abs(t - last) * pxPerUnit >= FINAL_TICK_GAP), last]
    .sort((a, b) => a - b);
}

function label(x, y, text, anchor = "start", extra = {}) {
  return svgEl("text", { x, y, "text-anchor": anchor, "font-size": 10, fill: "#666",
    "font-family": FONT, class: "ipydist-tick", ...extra }, text);
}

// TensorBoard's smoothing: an exponential moving average, debiased at the start (the static
// copy's `smooth` in static.py does the same).
function smooth(ys, weight) {
  let last = 0;
  return ys.map((y, i) => {
    last = last * weight + (1 - weight) * y;
    return last / (1 - Math.pow(weight, i + 1));
  });
}

// Min/max decimation to about `target` points (first and last kept).
function decimate(s, target) {
  const n = s.x.length;
  if (n <= target) return s;
  const buckets = Math.floor((target - 2) / 2), size = (n - 2) / buckets;
  const keep = [0];
  for (let b = 0; b < buckets; b++) {
    const lo = 1 + Math.floor(b * size), hi = Math.min(n - 1, 1 + Math.floor((b + 1) * size));
    if (lo >= hi) continue;
    let min = lo, max = lo;
    for (let i = lo; i < hi; i++) {
      if (s.y[i] < s.y[min]) min = i;
      if (s.y[i] > s.y[max]) max = i;
    }
    keep.push(Math.min(min, max));
    if (max !== min) keep.push(Math.max(min, max));
  }
  keep.push(n - 1);
  return { x: keep.map((i) => s.x[i]), y: keep.map((i) => s.y[i]), t: keep.map((i) => s.t[i]) };
}

// About `target` ticks at 1, 2 or 5 times a power of ten; `whole`: no fractional step (steps),
// `clock`: steps of seconds a clock reads well (1 s, 5 s, 30 s, 1 min, 5 min, 1 h ...).
function niceTicks(lo, hi, target, { whole = false, clock = false } = {}) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / target;
  let step;
  if (clock && raw >= 1) {
    step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400]
      .find((s) => s >= raw) || raw;
  } else {
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    step = [1, 2, 5, 10].map((k) => k * mag).find((s) => s >= raw) || raw;
    if (whole) step = Math.max(1, Math.round(step));
  }
  const out = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) {
    out.push(Number((i * step).toPrecision(12)));
  }
  return out;
}

// Index of the point nearest to x in a sorted array.
function nearest(xs, x) {
  let lo = 0, hi = xs.length - 1;
  if (hi < 0) return -1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid; else hi = mid;
  }
  return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
}

// The curves of one chart, as {name, color, x, y, best}: one per series, or (per rank) one per
// rank of each series that has per-rank points.
function chartCurves(chart, data, settings) {
  const xKey = settings.x === "time" ? "t" : "x";
  const perRank = settings.ranks && settings.ranks[chart.title];
  const curves = [];
  for (const s of chart.series) {
    const mine = data.series[s.name];
    const others = data.rankSeries[s.name];
    if (perRank && others) {
      const ranks = [["0", mine], ...Object.entries(others)].filter(([, v]) => v && v.x.length);
      ranks.sort((a, b) => Number(a[0]) - Number(b[0]));
      for (const [rank, v] of ranks) {
        curves.push({ name: `${s.name} · rank ${rank}`, color: RANK_COLORS[Number(rank) % RANK_COLORS.length],
          x: v[xKey], y: v.y, best: null });
      }
    } else if (mine && mine.x.length) {
      curves.push({ name: s.name, color: s.color, x: mine[xKey], y: mine.y, best: s.best });
    }
  }
  return curves;
}

// The steps (or times) at which the logged epoch changed.
function epochLines(data, settings) {
  const e = data.series.epoch;
  if (!e) return [];
  const xs = settings.x === "time" ? e.t : e.x;
  const out = [];
  for (let i = 1; i < e.y.length; i++) if (e.y[i] !== e.y[i - 1]) out.push(xs[i]);
  return out;
}

// The x range every chart shares (so a step lines up on all of them): all curves' extent.
function sharedDomain(charts, data, settings) {
  let lo = Infinity, hi = -Infinity;
  for (const chart of charts) {
    for (const c of chartCurves(chart, data, settings)) {
      if (!c.x.length) continue;
      lo = Math.min(lo, c.x[0]);
      hi = Math.max(hi, c.x[c.x.length - 1]);
    }
  }
  return Number.isFinite(lo) ? [lo, hi] : null;
}

// The x axis's name: the chosen axis, and how its ticks read.
function xAxisName(time, x1) {
  return time ? `time since the first point (${x1 >= 3600 ? "h:mm:ss" : "m:ss"})` : "step";
}

// Draws one chart over x range opts.domain; returns {node, hover(x), unhover(), domain, toX(px),
// top, bottom} (top and bottom: the plot area's, in px from the SVG's top).
function drawChart(chart, data, settings, opts) {
  const W = opts.width;
  const log = Boolean(settings.log && settings.log[chart.title]);
  const time = settings.x === "time";
  const plan = data.charts;
  const svg = svgEl("svg", { width: W, height: CHART_HEIGHT, class: "ipydist-chart",
    "data-chart": chart.title, xmlns: SVG_NS });
  const title = log ? `${chart.title} (log scale)` : chart.title;
  svg.appendChild(svgEl("text", { x: PAD_LEFT, y: 14, "font-size": 12, "font-weight": "bold",
    fill: "#222", "font-family": FONT, class: "ipydist-chart-title" }, title));
  const curves = chartCurves(chart, data, settings).map((c) => {
    const x = [], raw = [];
    for (let i = 0; i < c.x.length; i++) {
      const v = c.y[i];
      if (Number.isFinite(v) && (!log || v > 0)) { x.push(c.x[i]); raw.push(v); }
    }
    return { ...c, x, raw, y: log ? raw.map(Math.log10) : raw };
  }).filter((c) => c.x.length);
  svg.dataset.series = curves.map((c) => c.name).join(",");
  const result = { node: svg, hover() {}, unhover() {}, domain: null, toX: () => null,
    top: PAD_TOP, bottom: CHART_HEIGHT - PAD_BOTTOM };
  if (!curves.length) return result;

  // Smoothing (of the values themselves, also on a log scale, so the legend reads the same
  // either way), the best point, and the legend, whose lines set the chart's height.
  for (const c of curves) {
    const smoothed = settings.smoothing > 0 && c.raw.length >= plan.smooth_from;
    c.smoothRaw = smoothed ? smooth(c.raw, settings.smoothing) : null;
    c.smooth = c.smoothRaw && (log ? c.smoothRaw.map(Math.log10) : c.smoothRaw);
    c.bestAt = null;
    if (c.best && c.y.length > 1) {
      let b = 0;
      for (let i = 1; i < c.y.length; i++) {
        if (c.best === "min" ? c.y[i] < c.y[b] : c.y[i] > c.y[b]) b = i;
      }
      c.bestAt = b;
    }
    c.legend = legendText(c.name, c.raw[c.raw.length - 1],
      c.smoothRaw ? c.smoothRaw[c.smoothRaw.length - 1] : null,
      c.bestAt === null ? null : c.best, c.bestAt === null ? null : c.raw[c.bestAt]);
  }
  const legend = [];
  let lx = PAD_LEFT + textWidth(title, 12, "bold") + 12, line = 0;
  for (const c of curves) {
    const width = 13 + textWidth(c.legend);
    const right = line ? W - PAD_RIGHT : W - PAD_RIGHT - TOGGLES_WIDTH;
    if (lx + width > right && lx > PAD_LEFT) { lx = PAD_LEFT; line += 1; }
    legend.push({ c, x: lx, y: 12 + line * LEGEND_LINE });
    lx += width + 14;
  }
  const extra = line * LEGEND_LINE, top = PAD_TOP + extra, H = CHART_HEIGHT + extra;
  svg.setAttribute("height", H);
  result.top = top;
  result.bottom = H - PAD_BOTTOM;
  for (const { c, x, y } of legend) {
    svg.appendChild(svgEl("rect", { x, y: y - 5, width: 10, height: 3, fill: c.color }));
    svg.appendChild(label(x + 13, y, c.legend, "start", { fill: "#444", class: "ipydist-legend",
      "data-series": c.name }));
  }

  // y domain: what is visible in the x domain.
  let [x0, x1] = opts.domain || [Math.min(...curves.map((c) => c.x[0])),
    Math.max(...curves.map((c) => c.x[c.x.length - 1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  let y0 = Infinity, y1 = -Infinity;
  for (const c of curves) {
    for (let i = 0; i < c.x.length; i++) {
      if (c.x[i] >= x0 && c.x[i] <= x1) { y0 = Math.min(y0, c.y[i]); y1 = Math.max(y1, c.y[i]); }
    }
  }
  if (!Number.isFinite(y0)) { y0 = 0; y1 = 1; }
  if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 0.5; y0 -= pad; y1 += pad; }
  const plotW = W - PAD_LEFT - PAD_RIGHT, plotH = H - top - PAD_BOTTOM;
  const sx = (x) => PAD_LEFT + ((x - x0) / (x1 - x0)) * plotW;
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * plotH;
  result.domain = [x0, x1];
  result.toX = (px) => x0 + ((px - PAD_LEFT) / plotW) * (x1 - x0);

  // Axes. On a log scale the ticks are the decades (or 1-2-5 within one).
  let yt = log ? niceTicks(Math.floor(y0), Math.ceil(y1), 4, { whole: true }).filter((t) => t >= y0 && t <= y1) : niceTicks(y0, y1, 4);
  if (log && yt.length < 2) yt = niceTicks(y0, y1, 4);
  tickLabels(yt.map((t) => (log ? Math.pow(10, t) : t))).forEach((text, i) => {
    svg.appendChild(svgEl("line", { x1: PAD_LEFT, x2: W - PAD_RIGHT, y1: sy(yt[i]), y2: sy(yt[i]),
      stroke: "#e6e6e6", class: "ipydist-grid" }));
    svg.appendChild(label(PAD_LEFT - 4, sy(yt[i]) + 3.5, text, "end"));
  });
  const wholeSteps = !time && curves.every((c) => c.x.every(Number.isInteger));
  const lastX = Math.max(...curves.map((c) => c.x[c.x.length - 1]));
  const xt = xTicks(x0, x1, lastX, Math.max(2, Math.floor(plotW / 110)), plotW / (x1 - x0),
    { whole: wholeSteps, clock: time });
  const xLabels = time ? xt.map(duration) : tickLabels(xt);
  xt.forEach((t, i) => svg.appendChild(label(sx(t), H - PAD_BOTTOM + 14, xLabels[i], "middle")));
  svg.appendChild(label(PAD_LEFT + plotW / 2, H - 4, xAxisName(time, x1), "middle",
    { fill: "#444", class: "ipydist-axis-label" }));

  const clip = `ipydist-clip-${Math.random().toString(36).slice(2)}`;
  const defs = svgEl("defs", {});
  const clipPath = svgEl("clipPath", { id: clip });
  clipPath.appendChild(svgEl("rect", { x: PAD_LEFT - 6, y: top - 6, width: plotW + 12, height: plotH + 12 }));
  defs.appendChild(clipPath);
  svg.appendChild(defs);
  const plot = svgEl("g", { "clip-path": `url(#${clip})` });
  svg.appendChild(plot);

  for (const e of epochLines(data, settings)) {
    if (e < x0 || e > x1) continue;
    plot.appendChild(svgEl("line", { x1: sx(e), x2: sx(e), y1: top, y2: H - PAD_BOTTOM,
      stroke: "#bbb", "stroke-dasharray": "2,3", class: "ipydist-epoch" }));
  }

  // Curves: raw always drawn (faint when a smoothed line is drawn over it).
  const path = (c, ys) => ys.map((y, i) => `${i ? "L" : "M"}${sx(c.x[i]).toFixed(1)},${sy(y).toFixed(1)}`).join("");
  for (const c of curves) {
    const smoothed = c.smooth !== null;
    plot.appendChild(svgEl("path", { d: path(c, c.y), stroke: c.color, fill: "none",
      "stroke-width": smoothed ? 1 : 1.6, opacity: smoothed ? 0.3 : 1,
      class: smoothed ? "ipydist-raw" : "ipydist-line", "data-series": c.name }));
    if (smoothed) {
      plot.appendChild(svgEl("path", { d: path(c, c.smooth), stroke: c.color, fill: "none",
        "stroke-width": 1.6, class: "ipydist-line", "data-series": c.name }));
    }
    const visible = c.x.filter((x) => x >= x0 && x <= x1).length;
    if (visible <= plan.markers_up_to) {
      c.x.forEach((x, i) => plot.appendChild(svgEl("circle", { cx: sx(x), cy: sy(c.y[i]), r: 2.5,
        fill: c.color, class: "ipydist-marker" })));
    }
    if (c.bestAt !== null) {
      const b = c.bestAt;
      const at = time ? duration(c.x[b]) : `step ${count(c.x[b])}`;
      const dot = svgEl("circle", { cx: sx(c.x[b]), cy: sy(c.y[b]), r: 4.5, fill: "none",
        stroke: c.color, "stroke-width": 1.6, class: "ipydist-best", "data-series": c.name });
      dot.appendChild(svgEl("title", {}, `${c.best} of ${c.name}: ${number(c.raw[b])} at ${at}`));
      plot.appendChild(dot);
    }
  }

  // The crosshair: a line at the hovered x, a dot on each curve's nearest point.
  const cross = svgEl("g", { class: "ipydist-crosshair", visibility: "hidden" });
  const vline = svgEl("line", { y1: top, y2: H - PAD_BOTTOM, stroke: "#888", "stroke-width": 1 });
  cross.appendChild(vline);
  const dots = curves.map((c) => cross.appendChild(svgEl("circle", { r: 3.5, fill: c.color, stroke: "#fff" })));
  svg.appendChild(cross);
  result.hover = (x) => {
    const rows = [];
    curves.forEach((c, k) => {
      const i = nearest(c.x, x);
      if (i < 0 || c.x[i] < x0 || c.x[i] > x1) { dots[k].setAttribute("visibility", "hidden"); return; }
      dots[k].setAttribute("visibility", "visible");
      dots[k].setAttribute("cx", sx(c.x[i]));
      dots[k].setAttribute("cy", sy(c.smooth ? c.smooth[i] : c.y[i]));
      rows.push({ name: c.name, color: c.color, at: c.x[i], value: c.raw[i],
        smoothed: c.smoothRaw ? c.smoothRaw[i] : null });
    });
    vline.setAttribute("x1", sx(x));
    vline.setAttribute("x2", sx(x));
    cross.setAttribute("visibility", x >= x0 && x <= x1 ? "visible" : "hidden");
    return rows;
  };
  result.unhover = () => cross.setAttribute("visibility", "hidden");
  result.sx = sx;
  return result;
}
