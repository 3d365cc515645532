// The live metrics panel (anywidget; numbers.js and chart.js are joined before this file).
// Points arrive as custom messages ("append"), so adding one never resends the series; the
// synced `series` trait is only set when the cell ends, so the saved notebook's widget state
// holds the final (downsampled) curves. The reader's choices live in the synced `settings`
// trait, so they come back with the saved state and carry over to the next cell's widget.
// The chart plan is the `charts` trait: `layout` is every ipywidget's own (a Layout model).

const MAX_POINTS = 4000; // per curve; beyond this a curve is halved by min/max decimation
const DEFAULT_SETTINGS = { smoothing: 0.6, log: {}, ranks: {}, x: "step" };
// What the per-rank bar shows (static.py's OUTSIDE_COLLECTIVES says the same).
const OUTSIDE_COLLECTIVES = "time per step outside ipydist's collectives (computing, loading " +
  "data) on that rank; the rest of the step is spent waiting for the other ranks. The rank " +
  "with the most is the one the others wait for (a straggler when well above the median).";

// The chart plan ({charts, epoch, markers_up_to, smooth_from}). A notebook saved before the
// trait was renamed from `layout` keeps the plan there; anything else in `layout` (ipywidgets'
// reference to a Layout model) is not a plan and is ignored.
function chartPlan(model) {
  const plan = model.get("charts");
  if (plan && Array.isArray(plan.charts)) return plan;
  const old = model.get("layout");
  return old && typeof old === "object" && Array.isArray(old.charts) ? old : { charts: [] };
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
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

function asSeries([x, y, t]) {
  return { x: x.slice(), y: y.slice(), t: (t || x).slice() };
}

function fromTrait(series) {
  const out = {};
  for (const [name, s] of Object.entries(series || {})) out[name] = asSeries(s);
  return out;
}

function fromRankTrait(rankSeries) {
  const out = {};
  for (const [name, ranks] of Object.entries(rankSeries || {})) {
    out[name] = {};
    for (const [rank, s] of Object.entries(ranks)) out[name][rank] = asSeries(s);
  }
  return out;
}

// Adds points to a curve; with `overlap`, only those past its last step (an append that
// crossed the points a reopened page was caught up with: see "points" below).
function extend(target, [x, y, t], overlap = false) {
  if (overlap && target.x.length) {
    const last = target.x[target.x.length - 1];
    const keep = x.map((step, i) => (step > last ? i : -1)).filter((i) => i >= 0);
    [x, y, t] = [keep.map((i) => x[i]), keep.map((i) => y[i]), keep.map((i) => (t || x)[i])];
  }
  target.x.push(...x);
  target.y.push(...y);
  target.t.push(...(t || x));
  if (target.x.length > MAX_POINTS) Object.assign(target, decimate(target, MAX_POINTS / 2));
}

function download(name, blob) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.appendChild(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}

function localCsv(series) {
  const names = Object.keys(series);
  const rows = new Map();
  for (const name of names) {
    const s = series[name];
    s.x.forEach((x, i) => {
      const row = rows.get(x) || rows.set(x, { t: s.t[i] }).get(x);
      row[name] = s.y[i];
    });
  }
  const lines = [["step", "seconds", ...names].join(",")];
  for (const x of [...rows.keys()].sort((a, b) => a - b)) {
    const row = rows.get(x);
    lines.push([x, row.t, ...names.map((n) => (n in row ? row[n] : ""))].join(","));
  }
  return lines.join("\n") + "\n";
}

async function chartsToPng(svgs, summary, width) {
  const scale = 2, top = 24;
  const height = top + svgs.reduce((h, s) => h + Number(s.getAttribute("height")) + 6, 0);
  const canvas = document.createElement("canvas");
  canvas.width = width * scale;
  canvas.height = height * scale;
  const ctx = canvas.getContext("2d");
  ctx.scale(scale, scale);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  ctx.fillStyle = "#222";
  ctx.font = `12px ${FONT}`;
  ctx.fillText(summary, 4, 16);
  let y = top;
  for (const svg of svgs) {
    const copy = svg.cloneNode(true);
    copy.querySelectorAll(".ipydist-crosshair, .ipydist-zoom-box").forEach((e) => e.remove());
    const text = new XMLSerializer().serializeToString(copy);
    const img = new Image();
    await new Promise((resolve, reject) => {
      img.onload = resolve;
      img.onerror = reject;
      img.src = `data:image/svg+xml;charset=utf-8,${encodeURIComponent(text)}`;
    });
    ctx.drawImage(img, 0, y);
    y += Number(svg.getAttribute("height")) + 6;
  }
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}

function render({ model, el: host }) {
  hideFallback(model.get("key"));
  const root = el("div", "ipydist-metrics");
  const header = el("div", "ipydist-header");
  const progress = el("div", "ipydist-progress");
  const bar = el("div", "ipydist-bar");
  const barFill = el("div", "ipydist-bar-fill");
  bar.appendChild(barFill);
  const progressText = el("span", "ipydist-progress-text");
  progress.append(bar, progressText);

  const controls = el("div", "ipydist-controls");
  const smoothing = Object.assign(el("input", "ipydist-smoothing"),
    { type: "range", min: "0", max: "0.99", step: "0.01" });
  const smoothValue = el("span", "ipydist-smoothing-value");
  const smoothLabel = el("label");
  smoothLabel.append("smoothing ", smoothing, smoothValue);
  const xAxis = el("select", "ipydist-x-axis");
  xAxis.title = "the x axis of every chart: the logged step, or the time since the first point";
  for (const [value, text] of [["step", "x: step"], ["time", "x: time"]]) {
    xAxis.appendChild(Object.assign(el("option"), { value, textContent: text }));
  }
  const resetZoom = el("button", "ipydist-reset-zoom", "reset zoom");
  const pngButton = el("button", "ipydist-export-png", "PNG");
  const csvButton = el("button", "ipydist-export-csv", "CSV");
  pngButton.title = "save the charts as a PNG image";
  csvButton.title = "save this cell's points as CSV";
  controls.append(smoothLabel, xAxis, resetZoom, pngButton, csvButton);

  const charts = el("div", "ipydist-charts");
  const tooltip = el("div", "ipydist-hover");
  const strip = el("div", "ipydist-ranks");
  root.append(header, progress, controls, charts, strip, tooltip);
  host.appendChild(root);

  const data = {
    series: fromTrait(model.get("series")),
    rankSeries: fromRankTrait(model.get("rank_series")),
    charts: chartPlan(model),
  };
  let count_ = (model.get("stats") || {}).points || 0;
  let zoom = null;
  let drawn = []; // [{chart, result}]
  let hoverX = null;
  let dragging = false; // no redraw while the reader drags out a zoom: it would drop the drag

  function settings() {
    return { ...DEFAULT_SETTINGS, ...(model.get("settings") || {}) };
  }
  function setSetting(name, value) {
    model.set("settings", { ...settings(), [name]: value });
    model.save_changes();
  }

  // The header: each metric's last logged value (the legends add smoothed and min/max), then
  // how far the run got (where no progress bar says it), the rates, and how long it took.
  // The same words as the static copy's summary line (static.py's summary_line).
  let headerText = ""; // the header as one line, for the PNG (and data-summary)
  function drawHeader(stats) {
    header.replaceChildren();
    const latest = Object.entries(stats.latest || {});
    const text = [];
    if (latest.length) {
      text.push(`last: ${latest.map(([k, v]) => `${k} ${number(v)}`).join(" · ")}`);
      const values = el("span", "ipydist-latest");
      values.title = "the last value logged of each metric (rank 0's)";
      values.append(el("span", "ipydist-latest-label", "last: "));
      latest.forEach(([k, v], i) => values.append(i ? " · " : "", el("b", "", k), ` ${number(v)}`));
      header.append(values);
    }
    const rates = [];
    if (!hasProgress(stats) && stats.step !== null && stats.step !== undefined) {
      rates.push(`step ${count(stats.step)}`);
    }
    if (stats.steps_per_s) rates.push(`${number(stats.steps_per_s)} steps/s`);
    if (stats.samples_per_s) rates.push(`${number(stats.samples_per_s)} samples/s`);
    if (model.get("done") && stats.elapsed) rates.push(`done in ${duration(stats.elapsed)}`);
    if (rates.length) header.append(el("span", "ipydist-rates", rates.join(" · ")));
    // The same line as the static copy's summary (the progress bar's count in words).
    const where = hasProgress(stats) && stats.step !== null && stats.step !== undefined
      ? [`${count(stats.step + 1)} of ${count(stats.total)} steps`] : [];
    headerText = [...text, ...where, ...rates].join(" · ");
    header.dataset.summary = headerText;
  }

  function hasProgress(stats) {
    return stats.progress !== null && stats.progress !== undefined && Boolean(stats.total);
  }

  function drawProgress(stats) {
    const shown = hasProgress(stats);
    progress.style.display = shown ? "" : "none";
    if (!shown) return;
    const pct = Math.round(stats.progress * 100);
    barFill.style.width = `${pct}%`;
    // No ETA once the cell ended, nor before the kernel has one (stats.eta is null).
    let eta = "";
    if (!model.get("done") && Number.isFinite(stats.eta)) {
      eta = ` · ETA ${stats.eta < 1 ? "<0:01" : duration(stats.eta)}`;
    }
    const done = stats.step === null ? null : stats.step + 1; // steps count from 0
    progressText.textContent = `${count(done)} of ${count(stats.total)} steps · ${pct}%${eta}`;
  }

  function drawStrip(stats) {
    strip.replaceChildren();
    const ranks = (stats.ranks || []).filter((r) => r.step_s !== null);
    if (!ranks.length) return;
    const longest = Math.max(...ranks.map((r) => r.step_s || 0)) || 1;
    const title = el("div", "ipydist-ranks-title",
      `step time per rank · bar: time outside collectives, full bar = ${number(longest * 1000)} ms ` +
      "(the longest step time)");
    title.title = `The bar: ${OUTSIDE_COLLECTIVES}`;
    strip.appendChild(title);
    for (const r of ranks) {
      const row = el("div", "ipydist-rank" + (r.straggler ? " ipydist-straggler" : ""));
      row.dataset.rank = r.rank;
      row.title = `rank ${r.rank}: step ${number(r.step_s * 1000)} ms, outside collectives ` +
        `${number(r.compute_s * 1000)} ms, longest ${number(r.max_s * 1000)} ms`;
      const fill = el("div", "ipydist-rank-fill");
      fill.style.width = `${Math.max(2, (100 * Math.max(0, r.compute_s)) / longest)}%`;
      const track = el("div", "ipydist-rank-track");
      track.title = row.title;
      track.appendChild(fill);
      row.append(el("span", "", `rank ${r.rank}  ${number(r.step_s * 1000)} ms/step` +
        (r.straggler ? "  straggler" : "")), track);
      strip.appendChild(row);
    }
  }

  function chartToggles(chart, s) {
    const box = el("div", "ipydist-chart-toggles");
    const toggle = (name, text, on) => {
      const input = Object.assign(el("input", `ipydist-toggle-${name}`), { type: "checkbox", checked: on });
      input.addEventListener("change", () => {
        setSetting(name, { ...(s[name] || {}), [chart.title]: input.checked });
      });
      const lab = el("label");
      lab.append(input, ` ${text}`);
      return lab;
    };
    box.append(toggle("log", "log", Boolean(s.log[chart.title])));
    if (chart.series.some((x) => data.rankSeries[x.name])) {
      box.append(toggle("ranks", "per rank", Boolean(s.ranks[chart.title])));
    }
    return box;
  }

  function draw() {
    const stats = model.get("stats") || {};
    const s = settings();
    data.charts = chartPlan(model);
    root.dataset.points = String(count_);
    root.dataset.done = String(Boolean(model.get("done")));
    root.dataset.zoom = zoom ? zoom.join(",") : "";
    smoothing.value = String(s.smoothing);
    smoothValue.textContent = ` ${Number(s.smoothing).toFixed(2)}`;
    xAxis.value = s.x;
    resetZoom.style.display = zoom ? "" : "none";
    drawHeader(stats);
    drawProgress(stats);
    const width = Math.max(360, (root.clientWidth || 640) - 4);
    const planned = data.charts.charts || [];
    const domain = zoom || sharedDomain(planned, data, s);
    drawn = planned.map((chart) => {
      const result = drawChart(chart, data, s, { width, domain });
      const box = el("div", "ipydist-chart-box");
      box.append(result.node, chartToggles(chart, s));
      attachPointer(box, result);
      return { chart, result, box };
    });
    charts.replaceChildren(...drawn.map((d) => d.box));
    if (hoverX !== null) showHover(hoverX, null);
    drawStrip(stats);
  }

  // Hover: a crosshair at the same x on every chart, and a read-out of each curve's value.
  function showHover(x, anchor) {
    hoverX = x;
    const rows = drawn.flatMap((d) => d.result.hover(x));
    if (!rows.length) return hideHover();
    const s = settings();
    tooltip.replaceChildren();
    const at = rows.reduce((a, r) => (Math.abs(r.at - x) < Math.abs(a - x) ? r.at : a), rows[0].at);
    tooltip.appendChild(el("div", "ipydist-hover-x", s.x === "time" ? `time ${duration(at)}` : `step ${count(at)}`));
    for (const r of rows) {
      const line = el("div", "ipydist-hover-row");
      const swatch = el("span", "ipydist-swatch");
      swatch.style.background = r.color;
      line.append(swatch, `${r.name} ${number(r.value, 4)}`);
      if (r.at !== at) line.append(el("span", "ipydist-hover-smoothed", ` at ${s.x === "time" ? duration(r.at) : `step ${count(r.at)}`}`));
      if (r.smoothed !== null) line.append(el("span", "ipydist-hover-smoothed", ` (smoothed ${number(r.smoothed, 4)})`));
      tooltip.appendChild(line);
    }
    tooltip.style.display = "block";
    if (anchor) {
      const box = root.getBoundingClientRect();
      const left = anchor.clientX - box.left + 14;
      tooltip.style.left = `${Math.min(left, box.width - tooltip.offsetWidth - 4)}px`;
      tooltip.style.top = `${anchor.clientY - box.top + 12}px`;
    }
  }
  function hideHover() {
    hoverX = null;
    tooltip.style.display = "none";
    drawn.forEach((d) => d.result.unhover());
  }

  // Pointer: hover read-out; drag across a chart to zoom the x axis of every chart, double-click
  // to zoom out, the wheel to pan while zoomed.
  function attachPointer(box, result) {
    const svg = result.node;
    let dragFrom = null, zoomBox = null;
    const px = (ev) => ev.clientX - svg.getBoundingClientRect().left;
    svg.addEventListener("mousemove", (ev) => {
      const x = result.toX(px(ev));
      if (x === null) return;
      if (dragFrom !== null && zoomBox) {
        const a = Math.min(dragFrom, px(ev)), b = Math.max(dragFrom, px(ev));
        zoomBox.setAttribute("x", a);
        zoomBox.setAttribute("width", b - a);
      }
      showHover(x, ev);
    });
    svg.addEventListener("mouseleave", () => {
      hideHover();
      if (dragFrom !== null) schedule();
      dragFrom = null;
      dragging = false;
      zoomBox?.remove();
      zoomBox = null;
    });
    svg.addEventListener("mousedown", (ev) => {
      if (!result.domain || ev.button !== 0) return;
      ev.preventDefault();
      dragFrom = px(ev);
      dragging = true;
      zoomBox = svgEl("rect", { x: dragFrom, y: result.top, width: 0, height: result.bottom - result.top,
        fill: "#1f77b4", opacity: 0.12, class: "ipydist-zoom-box" });
      svg.appendChild(zoomBox);
    });
    svg.addEventListener("mouseup", (ev) => {
      if (dragFrom === null) return;
      const a = result.toX(Math.min(dragFrom, px(ev))), b = result.toX(Math.max(dragFrom, px(ev)));
      const wide = Math.abs(px(ev) - dragFrom) > 4;
      dragFrom = null;
      dragging = false;
      zoomBox?.remove();
      zoomBox = null;
      if (wide && b > a) zoom = [a, b];
      schedule();
    });
    svg.addEventListener("dblclick", () => { zoom = null; schedule(); });
    svg.addEventListener("wheel", (ev) => {
      if (!zoom) return; // without a zoom the page scrolls as usual
      ev.preventDefault();
      const span = zoom[1] - zoom[0], shift = (Math.sign(ev.deltaY || ev.deltaX) * span) / 10;
      zoom = [zoom[0] + shift, zoom[1] + shift];
      schedule();
    }, { passive: false });
  }

  let pending = false;
  function schedule() {
    root.dataset.points = String(count_);
    root.dataset.done = String(Boolean(model.get("done")));
    if (pending) return;
    pending = true;
    requestAnimationFrame(function later() {
      if (dragging) return requestAnimationFrame(later);
      pending = false;
      draw();
    });
  }

  let csvWaiting = null;
  let caughtUp = 0; // the points count a "points" reply brought
  function onMessage(msg) {
    if (!msg) return;
    if (msg.type === "csv" && csvWaiting) {
      clearTimeout(csvWaiting);
      csvWaiting = null;
      download("metrics.csv", new Blob([msg.text], { type: "text/csv" }));
      return;
    }
    if (msg.type === "points") { // every point so far, for a page that opened mid-cell
      if (model.get("done")) return; // the final curves came first
      data.series = fromTrait(msg.series);
      data.rankSeries = fromRankTrait(msg.rank_series);
      count_ = Math.max(count_, msg.count);
      caughtUp = msg.count;
      schedule();
      return;
    }
    if (msg.type !== "append" || msg.count <= caughtUp) return;
    const overlap = (msg.start || 0) < caughtUp;
    for (const [name, s] of Object.entries(msg.series || {})) {
      extend((data.series[name] ??= { x: [], y: [], t: [] }), s, overlap);
    }
    for (const [name, ranks] of Object.entries(msg.rank_series || {})) {
      for (const [rank, s] of Object.entries(ranks)) {
        extend(((data.rankSeries[name] ??= {})[rank] ??= { x: [], y: [], t: [] }), s, overlap);
      }
    }
    count_ = msg.count;
    schedule();
  }
  const onSeries = () => {
    data.series = fromTrait(model.get("series"));
    data.rankSeries = fromRankTrait(model.get("rank_series"));
    schedule();
  };
  const onStats = () => {
    count_ = Math.max(count_, (model.get("stats") || {}).points || 0);
    schedule();
  };
  model.on("msg:custom", onMessage);
  model.on("change:series", onSeries);
  model.on("change:rank_series", onSeries);
  model.on("change:stats", onStats);
  model.on("change:charts", schedule);
  model.on("change:settings", schedule);
  model.on("change:done", schedule);
  smoothing.addEventListener("input", () => {
    smoothValue.textContent = ` ${Number(smoothing.value).toFixed(2)}`;
    setSetting("smoothing", Number(smoothing.value));
  });
  xAxis.addEventListener("change", () => { zoom = null; setSetting("x", xAxis.value); });
  resetZoom.addEventListener("click", () => { zoom = null; schedule(); });
  pngButton.addEventListener("click", async () => {
    const blob = await chartsToPng(drawn.map((d) => d.result.node), headerText,
      Math.max(...drawn.map((d) => Number(d.result.node.getAttribute("width"))), 360));
    download("metrics.png", blob);
  });
  csvButton.addEventListener("click", () => {
    // The kernel has every point; without one (a reopened notebook), the curves shown here.
    model.send({ type: "csv" });
    csvWaiting = setTimeout(() => {
      csvWaiting = null;
      download("metrics.csv", new Blob([localCsv(data.series)], { type: "text/csv" }));
    }, 2000);
  });
  draw();
  // A page that opened while the cell runs (the notebook reopened, a second page) has the
  // widget's state but none of the points sent before: it asks the kernel for them.
  if (!model.get("done") && count_ > 0 && !Object.keys(data.series).length) {
    model.send({ type: "points" });
  }
  return () => {
    model.off("msg:custom", onMessage);
    model.off("change:series", onSeries);
    model.off("change:rank_series", onSeries);
    model.off("change:stats", onStats);
    model.off("change:charts", schedule);
    model.off("change:settings", schedule);
    model.off("change:done", schedule);
  };
}

export default { render };
