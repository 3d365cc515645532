// When the kernel restarts or dies while an %%everyrank cell runs, JupyterLab says nothing in
// the cell, and the cell's ranks are gone: a cluster's watchdog stops it when its kernel ends.
// This says so in the cell, where the person looks (queued %%everyrank cells get it too: they
// will not run). The live cluster view under %dist_start says the same (cluster.js).

const RUNS_ON_RANKS = /^\s*%%everyrank\b/;
const GONE = ["restarting", "autorestarting", "dead"];
export const NOTE = "[ipydist] the kernel restarted or stopped before this cell ended: its " +
  "ranks were stopped with it (run %dist_start again)\n";

export function noteRestarts(panel) {
  let kernel = null;
  const onStatus = (sender, status) => {
    if (!GONE.includes(status)) return;
    for (const cell of panel.content.widgets) {
      const model = cell.model;
      if (model.type !== "code" || model.executionState !== "running") continue;
      if (!RUNS_ON_RANKS.test(model.sharedModel.getSource())) continue;
      model.outputs.add({ output_type: "stream", name: "stderr", text: NOTE });
    }
  };
  const follow = () => {
    if (kernel) kernel.statusChanged.disconnect(onStatus);
    kernel = panel.sessionContext.session?.kernel ?? null;
    if (kernel) kernel.statusChanged.connect(onStatus);
  };
  panel.sessionContext.kernelChanged.connect(follow);
  panel.disposed.connect(() => { if (kernel) kernel.statusChanged.disconnect(onStatus); });
  follow();
}
