// ipydist's side panel in JupyterLab: the live cluster view of the current notebook's kernel.
// It opens a comm to the kernel (target "ipydist.cluster", registered by %load_ext ipydist;
// ipydist.notebook.live.cluster_panel feeds it once a second) and draws the rows with the
// same function as the notebook's widget (cluster.js). Interrupt is the kernel's own
// interrupt (JupyterLab's services), Restart and Stop are messages on the comm (shown only
// between cells).

import { INotebookTracker } from "@jupyterlab/notebook";
import { Widget } from "@lumino/widgets";

import { drawCluster } from "../src/ipydist/notebook/live/cluster.js";
import { CatchUp } from "./catch_up.js";
import { noteRestarts } from "./restart_note.js";

const TARGET = "ipydist.cluster";
const NO_IPYDIST = {
  rows: [], busy: false, stopped: true,
  caption: "no ipydist in this notebook's kernel: run %load_ext ipydist",
};

class ClusterPanel extends Widget {
  constructor(tracker) {
    super();
    this.id = "ipydist-cluster-panel";
    this.addClass("ipydist-panel");
    this.title.caption = "ipydist: every rank of this notebook's cluster";
    this.title.label = "ipydist";
    this.tracker = tracker;
    this.comm = null;
    this.kernel = null;
    this.heading = document.createElement("div");
    this.heading.className = "ipydist-panel-notebook";
    this.body = document.createElement("div");
    this.node.append(this.heading, this.body);
    this.connected = false;
    this.lastTry = 0;
    tracker.currentChanged.connect(() => this.follow());
    this.follow();
  }

  // Only a panel that is shown talks to the kernel: a kernel without ipydist logs each comm
  // it cannot open, so a hidden panel must not try after every cell.
  onAfterShow() { this.attach(); }

  // Follow the current notebook, and its kernel through restarts and changes.
  follow() {
    const panel = this.tracker.currentWidget;
    if (this.context) {
      this.context.kernelChanged.disconnect(this.attach, this);
      this.context.statusChanged.disconnect(this.onStatus, this);
    }
    this.context = panel ? panel.sessionContext : null;
    this.heading.textContent = panel ? panel.context.path : "no notebook";
    if (this.context) {
      this.context.kernelChanged.connect(this.attach, this);
      this.context.statusChanged.connect(this.onStatus, this);
    }
    this.attach();
  }

  // After a cell (the kernel idle again), a panel not yet connected tries again: the cell
  // may have loaded ipydist.
  onStatus(context, status) {
    if (status === "idle" && !this.connected && this.isVisible &&
        Date.now() - this.lastTry > 2000) {
      this.attach();
    }
  }

  async attach() {
    const kernel = this.context && this.context.session ? this.context.session.kernel : null;
    if (this.comm && !this.comm.isDisposed) {
      try { this.comm.close(); } catch (e) { /* the kernel is gone */ }
    }
    this.comm = null;
    this.connected = false;
    this.kernel = kernel;
    if (!kernel) {
      this.draw({ ...NO_IPYDIST, caption: "no kernel" });
      return;
    }
    if (!this.isVisible) return;
    this.lastTry = Date.now();
    const comm = kernel.createComm(TARGET);
    this.comm = comm;
    comm.onMsg = (msg) => {
      if (this.comm !== comm) return;
      this.connected = true;
      this.draw(msg.content.data.state);
    };
    comm.onClose = () => {
      if (this.comm !== comm) return;
      this.connected = false;
      this.draw(NO_IPYDIST);
    };
    if (!this.state || !this.connected) this.draw({ ...NO_IPYDIST, caption: "asking the kernel…" });
    try {
      // JupyterLab (4.5 and later) sends a comm's messages on a subshell of its own where
      // the kernel has subshells (ipykernel 7): the kernel then answers while a cell runs.
      // The comm is opened once that subshell exists, so that its opening goes there too.
      await kernel.info;
      if (kernel.supportsSubshells && comm.subshellStarted) {
        await comm.subshellStarted.catch(() => undefined);
      }
      if (this.comm !== comm) return;
      await comm.open({}).done;
    } catch (e) {
      if (this.comm === comm && !this.connected) this.draw(NO_IPYDIST);
    }
  }

  draw(state) {
    this.state = state;
    const note = drawCluster(this.body, { ...state, collapsed: false }, async (action) => {
      if (action === "interrupt" && this.kernel) {
        note.textContent = " interrupting…";
        await this.kernel.interrupt();
      } else if (this.comm) {
        note.textContent = action === "stop" ? " stopping…" : " restarting…";
        this.comm.send({ action });
      }
    }, null);
  }
}

const plugin = {
  id: "ipydist:cluster-panel",
  description: "The live cluster view of the current notebook's kernel, in the right sidebar.",
  autoStart: true,
  // app.shell, not ILabShell: Notebook 7's shell has a right sidebar too, and no ILabShell
  requires: [INotebookTracker],
  activate: (app, tracker) => {
    app.shell.add(new ClusterPanel(tracker), "right", { rank: 900 });
  },
};

// In each notebook that opens: cells that ran while no page was there, caught up
// (catch_up.js), and a word in an %%everyrank cell that a kernel restart ends (restart_note.js).
const cells = {
  id: "ipydist:cells",
  description: "Shows the output of cells that ran while no page had the notebook open, and " +
    "what a kernel restart did to a cell's ranks.",
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app, tracker) => {
    tracker.widgetAdded.connect((sender, panel) => {
      new CatchUp(panel);
      noteRestarts(panel);
    });
  },
};

export default [plugin, cells];
