// The live metrics view (anywidget ES module). Points arrive as custom messages ("append"),
// so adding one never resends the series; the synced `series` trait is only set when the cell
// ends, so the saved notebook's widget state holds the final (downsampled) curves.

const MAX_POINTS = 4000; // per metric; beyond this the series is halved by min/max decimation
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];

function decimate(xs, ys, target) {
  const n = xs.length;
  if (n <= target) return [xs, ys];
  const buckets = Math.floor((target - 2) / 2);
  const size = (n - 2) / buckets;
  const keep = [0];
  for (let b = 0; b < buckets; b++) {
    const lo = 1 + Math.floor(b * size);
    const hi = Math.min(n - 1, 1 + Math.floor((b + 1) * size));
    if (lo >= hi) continue;
    let min = lo, max = lo;
    for (let i = lo; i < hi; i++) {
      if (ys[i] < ys[min]) min = i;
      if (ys[i] > ys[max]) max = i;
    }
    keep.push(Math.min(min, max));
    if (max !== min) keep.push(Math.max(min, max));
  }
  keep.push(n - 1);
  return [keep.map((i) => xs[i]), keep.map((i) => ys[i])];
}

// TensorBoard's smoothing: an exponential moving average, debiased at the start.
function smooth(ys, weight) {
  if (weight <= 0) return ys;
  let last = 0, n = 0;
  return ys.map((y) => {
    last = last * weight + (1 - weight) * y;
    n += 1;
    return last / (1 - Math.pow(weight, n));
  });
}

function fmt(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return v.toPrecision(4);
}

function fmtDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  const pad = (x) => String(x).padStart(2, "0");
  return h ? `${h}:${pad(m)}:${pad(sec)}` : `${m}:${pad(sec)}`;
}

function ticks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((k) => k * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
  return out;
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function drawChart(name, xs, ys, color, opts) {
  const W = opts.width, H = 150, L = 58, R = 10, T = 18, B = 22;
  const svg = svgEl("svg", { width: W, height: H, class: "ipydist-chart", "data-metric": name });
  svg.appendChild(svgEl("text", { x: L, y: 12, class: "ipydist-chart-title" }, name));
  const log = opts.logScale;
  const pts = [];
  for (let i = 0; i < xs.length; i++) {
    const y = ys[i];
    if (Number.isFinite(y) && (!log || y > 0)) pts.push([xs[i], log ? Math.log10(y) : y]);
  }
  if (!pts.length) return svg;
  let x0 = pts[0][0], x1 = pts[pts.length - 1][0];
  let y0 = Infinity, y1 = -Infinity;
  for (const [, y] of pts) { y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const t of ticks(y0, y1, 3)) {
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "ipydist-grid" }));
    svg.appendChild(svgEl("text", { x: L - 4, y: sy(t) + 4, class: "ipydist-tick", "text-anchor": "end" },
      fmt(log ? Math.pow(10, t) : t)));
  }
  for (const t of ticks(x0, x1, 4)) {
    svg.appendChild(svgEl("text", { x: sx(t), y: H - 6, class: "ipydist-tick", "text-anchor": "middle" }, fmt(t)));
  }
  const path = (values) => values.map((y, i) => `${i ? "L" : "M"}${sx(pts[i][0]).toFixed(1)},${sy(y).toFixed(1)}`).join("");
  const raw = pts.map((p) => p[1]);
  const smoothed = smooth(raw, opts.smoothing);
  if (smoothed !== raw) {
    svg.appendChild(svgEl("path", { d: path(raw), stroke: color, class: "ipydist-raw" }));
  }
  svg.appendChild(svgEl("path", { d: path(smoothed), stroke: color, class: "ipydist-line" }));
  return svg;
}

function hideFallback(key) {
  // The static copy of the chart (for nbconvert and GitHub) sits next to the widget; where the
  // widget itself renders, it is redundant, so hide it.
  const id = `ipydist-hide-${key}`;
  if (!key || document.getElementById(id)) return;
  const style = document.createElement("style");
  style.id = id;
  style.textContent = `.ipydist-fallback-${key} { display: none !important; }`;
  document.head.appendChild(style);
}

function fromTrait(series) {
  const out = {};
  for (const [name, [xs, ys]] of Object.entries(series || {})) out[name] = { x: xs.slice(), y: ys.slice() };
  return out;
}

function render({ model, el }) {
  hideFallback(model.get("key"));
  const root = document.createElement("div");
  root.className = "ipydist-metrics";
  const header = document.createElement("div");
  header.className = "ipydist-header";
  const progress = document.createElement("div");
  progress.className = "ipydist-progress";
  const bar = document.createElement("div");
  bar.className = "ipydist-bar";
  const barFill = document.createElement("div");
  barFill.className = "ipydist-bar-fill";
  bar.appendChild(barFill);
  const progressText = document.createElement("span");
  progress.append(bar, progressText);

  const controls = document.createElement("div");
  controls.className = "ipydist-controls";
  const logBox = document.createElement("input");
  logBox.type = "checkbox";
  logBox.className = "ipydist-log";
  const logLabel = document.createElement("label");
  logLabel.append(logBox, " log scale");
  const smoothing = document.createElement("input");
  Object.assign(smoothing, { type: "range", min: "0", max: "0.99", step: "0.01", value: "0.6" });
  smoothing.className = "ipydist-smoothing";
  const smoothValue = document.createElement("span");
  const smoothLabel = document.createElement("label");
  smoothLabel.append("smoothing ", smoothing, smoothValue);
  controls.append(logLabel, smoothLabel);

  const charts = document.createElement("div");
  charts.className = "ipydist-charts";
  const strip = document.createElement("div");
  strip.className = "ipydist-ranks";
  root.append(header, progress, controls, charts, strip);
  el.appendChild(root);

  let series = fromTrait(model.get("series"));
  let count = (model.get("stats") || {}).points || 0;

  function drawHeader(stats) {
    header.replaceChildren();
    Object.entries(stats.latest || {}).forEach(([k, v], i) => {
      const name = document.createElement("b");
      name.textContent = k;
      header.append(i ? " · " : "", name, ` ${fmt(v)}`);
    });
    const rates = [];
    if (stats.steps_per_s) rates.push(`${fmt(stats.steps_per_s)} steps/s`);
    if (stats.samples_per_s) rates.push(`${fmt(Math.round(stats.samples_per_s))} samples/s`);
    rates.push(`${count.toLocaleString("en-US")} points`);
    if (model.get("done") && stats.elapsed) rates.push(`done in ${fmtDuration(stats.elapsed)}`);
    const span = document.createElement("span");
    span.className = "ipydist-rates";
    span.textContent = rates.join(" · ");
    header.append(span);
  }

  function drawProgress(stats) {
    progress.style.display = stats.progress === null || stats.progress === undefined ? "none" : "";
    if (progress.style.display === "none") return;
    const pct = Math.round(stats.progress * 100);
    barFill.style.width = `${pct}%`;
    const eta = model.get("done") ? "" : ` · ETA ${fmtDuration(stats.eta)}`;
    const done = stats.step === null ? null : stats.step + 1; // steps count from 0
    progressText.textContent = ` ${fmt(done)} of ${fmt(stats.total)} steps · ${pct}%${eta}`;
  }

  function drawStrip(stats) {
    strip.replaceChildren();
    const ranks = (stats.ranks || []).filter((r) => r.step_s !== null);
    if (!ranks.length) return;
    const title = document.createElement("div");
    title.className = "ipydist-ranks-title";
    title.textContent = "step time per rank (bar: time outside collectives)";
    strip.appendChild(title);
    const longest = Math.max(...ranks.map((r) => r.step_s || 0)) || 1;
    for (const r of ranks) {
      const row = document.createElement("div");
      row.className = "ipydist-rank" + (r.straggler ? " ipydist-straggler" : "");
      row.dataset.rank = r.rank;
      row.title = `rank ${r.rank}: step ${fmt(r.step_s * 1000)} ms, outside collectives ` +
        `${fmt(r.compute_s * 1000)} ms, longest ${fmt(r.max_s * 1000)} ms`;
      const fill = document.createElement("div");
      fill.className = "ipydist-rank-fill";
      fill.style.width = `${Math.max(2, (100 * Math.max(0, r.compute_s)) / longest)}%`;
      const label = document.createElement("span");
      label.textContent = `rank ${r.rank}  ${fmt(r.step_s * 1000)} ms/step` +
        (r.straggler ? "  straggler" : "");
      const track = document.createElement("div");
      track.className = "ipydist-rank-track";
      track.appendChild(fill);
      row.append(label, track);
      strip.appendChild(row);
    }
  }

  function draw() {
    const stats = model.get("stats") || {};
    root.dataset.points = String(count);
    root.dataset.done = String(Boolean(model.get("done")));
    smoothValue.textContent = ` ${Number(smoothing.value).toFixed(2)}`;
    drawHeader(stats);
    drawProgress(stats);
    const opts = {
      width: Math.max(320, (root.clientWidth || 640) - 4),
      logScale: logBox.checked,
      smoothing: Number(smoothing.value),
    };
    charts.replaceChildren(...Object.entries(series).map(([name, s], i) =>
      drawChart(name, s.x, s.y, COLORS[i % COLORS.length], opts)));
    drawStrip(stats);
  }

  let pending = false;
  function schedule() {
    root.dataset.points = String(count);
    root.dataset.done = String(Boolean(model.get("done")));
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  }

  function onMessage(msg) {
    if (!msg || msg.type !== "append") return;
    for (const [name, [xs, ys]] of Object.entries(msg.series)) {
      const s = (series[name] ??= { x: [], y: [] });
      s.x.push(...xs);
      s.y.push(...ys);
      if (s.x.length > MAX_POINTS) [s.x, s.y] = decimate(s.x, s.y, MAX_POINTS / 2);
    }
    count = msg.count;
    schedule();
  }
  function onSeries() {
    series = fromTrait(model.get("series"));
    schedule();
  }
  function onStats() {
    count = Math.max(count, (model.get("stats") || {}).points || 0);
    schedule();
  }
  model.on("msg:custom", onMessage);
  model.on("change:series", onSeries);
  model.on("change:stats", onStats);
  model.on("change:done", schedule);
  logBox.addEventListener("change", schedule);
  smoothing.addEventListener("input", schedule);
  draw();
  return () => {
    model.off("msg:custom", onMessage);
    model.off("change:series", onSeries);
    model.off("change:stats", onStats);
    model.off("change:done", schedule);
  };
}

export default { render };
