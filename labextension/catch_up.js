// ipydist's catch-up: a page that opens a notebook whose kernel ran cells while no page was
// there (the laptop closed during training) shows those cells as a page that stayed would have:
// their output so far, the cell running ([*]) where it still runs, and what follows, live.
//
// JupyterLab shows a cell's output only to the page that ran it, and only while that page is
// open (jupyterlab#2833). ipydist keeps the last cells' output in the kernel
// (ipydist.notebook.reopen.kept_cells); the kernel's kernel_info reply says so
// (ipydist_kept_cells), answered at once even while a cell runs (reopen/busy_shell.py). Then
// this plugin opens the comm "ipydist.kept_cells" and gets every kept cell in one message.
// A cell this page ran itself, one it cannot find (deleted; or run by the server under
// jupyter-server-nbmodel, which writes the output into the document itself), and one whose
// output the page already shows as kept are left alone.
//
// The IOPub messages that follow are applied to a running cell's output as JupyterLab applies
// its own: streams joined, displays updated by their display id, clear_output. Messages that
// arrive before the reply are held; the reply names its last messages, and those are not
// applied again.

const TARGET = "ipydist.kept_cells";
const KEPT_KEY = "ipydist_kept_cells";

function outputOf(msg) {
  const c = msg.content;
  switch (msg.header.msg_type) {
    case "stream": return { output_type: "stream", name: c.name, text: c.text };
    case "display_data": return { output_type: "display_data", data: c.data, metadata: c.metadata || {} };
    case "execute_result":
      return { output_type: "execute_result", data: c.data, metadata: c.metadata || {},
        execution_count: c.execution_count };
    case "error":
      return { output_type: "error", ename: c.ename, evalue: c.evalue, traceback: c.traceback };
    default: return null;
  }
}

// One cell followed live: its model and where each display id's outputs are.
class Followed {
  constructor(model, kept) {
    this.model = model;
    this.count = kept.execution_count;
    this.displays = new Map(Object.entries(kept.display_ids || {}));
  }

  apply(msg) {
    const outputs = this.model.outputs;
    const type = msg.header.msg_type;
    const c = msg.content;
    if (type === "status") {
      if (c.execution_state !== "idle") return false;
      this.model.executionCount = this.count;
      this.model.executionState = "idle";
      return true; // followed to its end
    }
    if (type === "execute_input") this.count = c.execution_count;
    else if (type === "clear_output") {
      outputs.clear(Boolean(c.wait));
      this.displays.clear();
    } else if (type === "update_display_data") {
      const id = (c.transient || {}).display_id;
      for (const i of this.displays.get(id) || []) {
        const old = outputs.get(i);
        if (old) outputs.set(i, { ...old.toJSON(), data: c.data, metadata: c.metadata || {} });
      }
    } else {
      const output = outputOf(msg);
      if (!output) return false;
      outputs.add(output);
      const id = (c.transient || {}).display_id;
      if (id) this.displays.set(id, [...(this.displays.get(id) || []), outputs.length - 1]);
    }
    return false;
  }
}

export class CatchUp {
  constructor(panel) {
    this.panel = panel;
    this.kernel = null;
    this.held = null; // IOPub messages that came while the kept cells were asked for
    this.again = false; // ask once more when the reply comes
    this.followed = new Map(); // execute request's msg_id -> Followed
    this.handled = new Set(); // execute requests this page shows already
    this.skip = new Set(); // ids of messages the kept cells already held
    panel.sessionContext.ready.then(() => this.attach()).catch(() => undefined);
    panel.disposed.connect(() => this.detach());
  }

  detach() {
    if (this.kernel) this.kernel.iopubMessage.disconnect(this.onIOPub, this);
    this.kernel = null;
    this.followed.clear();
  }

  async attach() {
    const kernel = this.panel.sessionContext.session?.kernel;
    if (!kernel) return;
    const info = await kernel.info.catch(() => null);
    if (!info || !info[KEPT_KEY] || this.kernel) return;
    this.kernel = kernel;
    kernel.iopubMessage.connect(this.onIOPub, this);
    kernel.statusChanged.connect(() => {
      if (kernel.status === "restarting" || kernel.status === "dead") this.detach();
    });
    await this.ask();
  }

  // The kept cells, in one message on a comm of their own (opened on the comm target's
  // subshell, so that it is answered while a cell runs).
  async ask() {
    if (this.held) {
      this.again = true;
      return;
    }
    const kernel = this.kernel;
    this.held = [];
    const comm = kernel.createComm(TARGET);
    comm.onMsg = (msg) => {
      comm.close();
      this.show(msg.content.data.cells || []);
    };
    try {
      if (kernel.supportsSubshells && comm.subshellStarted) {
        await comm.subshellStarted.catch(() => undefined);
      }
      await comm.open({ known: [...this.handled] }).done;
    } catch (e) {
      this.held = null;
    }
  }

  onIOPub(kernel, msg) {
    if (this.held) {
      this.held.push(msg);
      return;
    }
    this.route(msg);
  }

  route(msg) {
    if (!this.kernel) return; // (restarted meanwhile)
    const parent = msg.parent_header || {};
    // A cell another page (or a queued Run All of the page that left) starts: ask again.
    if (msg.header.msg_type === "execute_input" && parent.session !== this.kernel.clientId &&
        !this.handled.has(parent.msg_id)) {
      this.ask();
      return;
    }
    const followed = parent.msg_id ? this.followed.get(parent.msg_id) : null;
    if (!followed || this.skip.has(msg.header.msg_id)) return;
    if (followed.apply(msg)) this.followed.delete(parent.msg_id);
  }

  cellModel(id) {
    if (!id) return null;
    const cell = this.panel.content.widgets.find((c) => c.model.id === id);
    return cell && cell.model.type === "code" ? cell.model : null;
  }

  show(cells) {
    for (const kept of cells) {
      if (this.handled.has(kept.msg_id) || kept.session === this.kernel?.clientId) continue;
      if (kept.cell_id === "") this.handled.add(kept.msg_id); // run by no notebook's cell
      const model = this.cellModel(kept.cell_id);
      if (!model) continue;
      this.handled.add(kept.msg_id);
      // a cell that ended and was saved with that run's number shows that run already
      if (kept.done && model.executionCount === kept.execution_count) continue;
      kept.recent.forEach((id) => this.skip.add(id));
      // trusted as the output of a cell the page ran (JupyterLab trusts what its kernel
      // sends live): the widgets render, not their text
      model.trusted = true;
      if (JSON.stringify(model.outputs.toJSON()) !== JSON.stringify(kept.outputs)) {
        model.outputs.clear();
        kept.outputs.forEach((output) => model.outputs.add(output));
      }
      if (kept.done) {
        if (model.executionCount !== kept.execution_count) {
          model.executionCount = kept.execution_count;
        }
      } else {
        model.executionState = "running";
        this.followed.set(kept.msg_id, new Followed(model, kept));
      }
    }
    const held = this.held || [];
    this.held = null;
    held.forEach((msg) => this.route(msg));
    if (this.again) {
      this.again = false;
      this.ask();
    }
  }
}
