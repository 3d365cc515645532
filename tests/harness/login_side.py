"""The notebook's side on the login host of a namespace cluster (netns_hosts.py): a short
Python program there starts a ``Session`` on the nodes, runs a test's body, and prints one JSON
line of what it saw, for the test to check."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap

from netns_hosts import HostCluster


def notebook_side(cluster: HostCluster, body: str, rank_code: str = "",
                  timeout: float = 240, elastic: bool | None = None, transport: str = "auto",
                  mpi_args: tuple[str, ...] = ()) -> dict:
    """Run ``body`` on the login host with ``session`` started on both nodes (2 ranks each;
    ``elastic`` and ``transport`` as ``Session`` takes them, ``mpi_args`` added to mpiexec's);
    ``body`` fills the dict ``out``, printed as the last line, and finds ``rank_code`` in
    ``RANK_CODE``."""
    hosts = ",".join(f"{h.name}:2" for h in cluster.hosts)
    mpi_args = shlex.join(["--prtemca", "plm_ssh_agent", cluster.rsh_agent, *mpi_args])
    program = "\n".join([
        "import json, sys",
        "from ipydist import Session",
        "out = {}",
        f"RANK_CODE = {textwrap.dedent(rank_code)!r}",
        f"session = Session(hosts={hosts!r}, mpi_args={mpi_args!r}, timeout=180, "
        f"elastic={elastic}, transport={transport!r})",
        "try:",
        "    session.start()",
        textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
        "finally:",
        "    session.stop(quiet=True)",
        "print('RESULT ' + json.dumps(out))",
    ])
    done = cluster.run("login", [sys.executable, "-c", program], capture_output=True,
                       timeout=timeout)
    text = done.stdout.decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"exit {done.returncode}\n{text[-3000:]}\n{done.stderr.decode(errors='replace')[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "_stdout": text}
