// The live cluster view (ipydist.notebook.live.cluster_view): a caption with the buttons,
// then one row per rank. Plain ES, no build step; the JupyterLab side panel draws the same
// rows with the same function (drawCluster), fed by a comm instead of a widget model.

const COLUMNS = [
  ["rank", "rank"], ["host", "host"], ["pid", "pid"], ["state", "state"],
  ["cpu", "CPU"], ["memory", "memory"], ["gpu", "GPU"], ["step", "step"],
];

function pageConfig() {
  const el = document.getElementById("jupyter-config-data");
  try { return el ? JSON.parse(el.textContent) : {}; } catch (e) { return {}; }
}

// Interrupt the kernel as the toolbar's stop button does: the Jupyter server's REST call.
// A widget message would wait behind the running cell in the kernel's shell.
export async function interruptKernel(kernelId) {
  if (!kernelId) return false;
  const config = pageConfig();
  const base = (config.baseUrl || "/").replace(/\/?$/, "/");
  const headers = {};
  const xsrf = document.cookie.match(/(?:^|;\s*)_xsrf=([^;]*)/);
  if (xsrf) headers["X-XSRFToken"] = decodeURIComponent(xsrf[1]);
  if (config.token) headers["Authorization"] = "token " + config.token;
  try {
    const reply = await fetch(`${base}api/kernels/${kernelId}/interrupt`,
      { method: "POST", headers, credentials: "same-origin" });
    return reply.ok;
  } catch (e) {
    return false;
  }
}

function button(label, title, onClick) {
  const b = document.createElement("button");
  b.className = "ipydist-cluster-button";
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

// Draw `state` ({rows, caption, busy, stopped, collapsed}) into `el`; `act(name)` runs a
// button's action ("interrupt", "restart", "stop"); `toggle()` collapses or opens it.
export function drawCluster(el, state, act, toggle) {
  el.replaceChildren();
  el.classList.add("ipydist-cluster");
  const head = document.createElement("div");
  head.className = "ipydist-cluster-head";
  const caption = document.createElement("span");
  caption.className = "ipydist-cluster-caption";
  caption.textContent = (toggle ? (state.collapsed ? "▸ " : "▾ ") : "") + state.caption;
  if (toggle) caption.addEventListener("click", toggle);
  head.append(caption);
  if (!state.stopped) {
    if (state.busy) {
      head.append(button("Interrupt", "interrupt the running cell on every rank, as the " +
        "stop button does", () => act("interrupt")));
    } else {
      head.append(button("Restart", "stop the ranks and start fresh ones (%dist_restart)",
        () => act("restart")));
      head.append(button("Stop", "stop the ranks (%dist_stop)", () => act("stop")));
    }
  }
  const note = document.createElement("span");
  note.className = "ipydist-cluster-note";
  head.append(note);
  el.append(head);
  if (state.collapsed || !state.rows.length) return note;
  const used = COLUMNS.filter(([key]) => key === "rank" || key === "state" ||
    state.rows.some((r) => r[key] !== "" && r[key] !== undefined));
  const table = document.createElement("table");
  table.className = "ipydist-cluster-table";
  const header = table.createTHead().insertRow();
  for (const [key, title] of used) {
    const th = document.createElement("th");
    th.textContent = title;
    th.className = `ipydist-cluster-${key}`;
    header.append(th);
  }
  const body = table.createTBody();
  for (const r of state.rows) {
    const tr = body.insertRow();
    // not "ipydist-rank": the metrics chart's stylesheet lays out its rank strip's rows
    // by that class (display: flex), which broke this table's columns on a page with both
    tr.className = `ipydist-cluster-row ipydist-cluster-row-${r.kind}`;
    tr.dataset.rank = r.rank;
    tr.title = `rank ${r.rank}` + (r.host ? ` on ${r.host}` : "") + (r.pid ? `, pid ${r.pid}` : "");
    for (const [key] of used) {
      const td = tr.insertCell();
      td.textContent = String(r[key] ?? "");
      td.className = `ipydist-cluster-${key}`;
    }
  }
  el.append(table);
  return note;
}

// What the view says once its kernel restarted or died (its comm then closes): the view no
// longer updates, and the ranks ended with the kernel (a cluster's watchdog stops it then).
export const KERNEL_GONE = "the kernel restarted or stopped: its ranks were stopped with it";

function render({ model, el }) {
  const names = ["rows", "caption", "busy", "stopped", "collapsed"];
  let gone = false;
  const draw = () => {
    const state = Object.fromEntries(names.map((n) => [n, model.get(n)]));
    if (gone) Object.assign(state, { caption: KERNEL_GONE, stopped: true, rows: [] });
    const note = drawCluster(el, state, async (action) => {
      if (action === "interrupt") {
        const ok = await interruptKernel(model.get("kernel_id"));
        note.textContent = ok ? " interrupting…" :
          " this page cannot interrupt the kernel: use the stop button";
      } else {
        note.textContent = action === "stop" ? " stopping…" : " restarting…";
        model.send({ action });
      }
    }, () => { model.set("collapsed", !model.get("collapsed")); model.save_changes(); });
  };
  for (const n of names) model.on(`change:${n}`, draw);
  // ipywidgets closes every model's comm when the kernel restarts (comm_live turns false)
  const closed = () => {
    const kernel = model.widget_manager?.kernel;
    if (kernel && !["restarting", "autorestarting", "dead"].includes(kernel.status)) return;
    gone = true;
    draw();
  };
  model.on("comm_live_update", closed);
  draw();
  return () => {
    for (const n of names) model.off(`change:${n}`, draw);
    model.off("comm_live_update", closed);
  };
}

export default { render };
