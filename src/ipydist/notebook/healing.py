"""Notebook side of ``--elastic``: after a rank died, the cluster heals around the survivors.

The cell in which a rank died ends as before (``RankDied``, the survivors released), and a
:class:`Heal` starts at once, in a thread of the kernel, so that the cell's message is not held
back: the survivors make the world again with a replacement for each dead rank
(``ipydist.rank.calls.heal``), the replacement registers with the controller as a new engine
(the cluster maps the rank to it), and rank 0 copies its variables and random states to it
(``ipydist.rank.calls.copy_state``). The next cell, ``pull``, ``push`` or ``%dist_status``
waits for the heal and says what it did, or, should it fail, what to do instead.
"""

from __future__ import annotations

import threading
import time

from ipydist import protocol
from ipydist.notebook.launch import processes
from ipydist.specs import describe_ranks

#: How long the heal may take (spawning a replacement, its torch import, its registration,
#: the copy) before it is given up.
HEAL_SECONDS = 60.0


class Heal:
    """One heal, for the ranks ``dead`` of ``cluster``, run in a thread."""

    def __init__(self, cluster, dead: list[int], restart: str):
        self.cluster = cluster
        self.dead = sorted(dead)
        self.restart = restart
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="ipydist-heal", daemon=True)

    def start(self) -> Heal:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> list[str]:
        """Wait for the heal to end; the lines that say what it did."""
        self._thread.join()
        return self.lines

    def _run(self) -> None:
        try:
            self.lines = self._heal()
        except Exception as e:  # the cluster cannot be used: say what to do
            self.failed = str(e)
            self.lines = [f"Replacing {describe_ranks(self.dead)} failed ({e}); run "
                          f"{self.restart} to start a fresh cluster."]

    def _heal(self) -> list[str]:
        cluster = self.cluster
        client = cluster.client
        survivors = [r for r in range(cluster.size) if r not in self.dead]
        known = set(client.ids)
        deadline = self.started + HEAL_SECONDS
        healing = cluster.view(survivors).apply_async(protocol.on_rank, "heal", self.dead, True)
        new: list[int] = []
        while not (healing.ready() and len(new) >= len(self.dead)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done within {HEAL_SECONDS:g} s")
            if not processes.alive(cluster.launcher_process()):
                raise RuntimeError("mpiexec ended")
            new = sorted(set(client.ids) - known)
            time.sleep(0.05)
        healing.get()  # a survivor's error, if any
        for engine_id in new:
            info = client[engine_id].apply_sync(protocol.on_rank, "attach")
            cluster.replace_rank(info["rank"], engine_id, info)
        root = survivors[0]
        copied = cluster.call("copy_state", root, self.dead,
                              timeout=max(deadline - time.monotonic(), 1.0))
        failed = [f"rank {r}: {reply['failed']}" for r, reply in enumerate(copied)
                  if reply.get("failed")]
        if failed:
            raise RuntimeError(f"loading rank {root}'s variables failed on {'; '.join(failed)}")
        seconds = time.monotonic() - self.started
        one = len(self.dead) == 1
        pids = ", ".join(str(cluster.ranks[r]["pid"]) for r in self.dead)
        line = (f"{describe_ranks(self.dead)} {'was' if one else 'were'} replaced in "
                f"{seconds:.1f} s (pid {pids}), {'its' if one else 'their'} variables and "
                f"random states copied from rank {root} ({copied[root]['bytes'] / 2**20:.1f} "
                "MB); the other ranks kept theirs.")
        skipped = copied[root]["skipped"]
        if skipped:
            line += f" Not copied (they do not pickle): {', '.join(skipped)}."
        rebound = sorted({name for reply in copied for name in reply["rebound"]})
        if rebound:
            line += f" Rebound to the new rank's part of the data: {', '.join(rebound)}."
        return [line]
