"""The notebook's side on the login host of a namespace cluster (netns_hosts.py): a short
Python program there starts a ``Session`` on the nodes, runs a test's body, and prints one JSON
line of what it saw, for the test to check."""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import sys
import textwrap
import threading
import time

from netns_hosts import HostCluster


def _placement(cluster: HostCluster, mpi_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """``Session``'s ``hosts`` (2 ranks on each node) and ``mpi_args`` (mpiexec's ssh through
    the namespaces, then ``mpi_args``) for ``cluster``."""
    return (",".join(f"{h.name}:2" for h in cluster.hosts),
            shlex.join(["--prtemca", "plm_ssh_agent", cluster.rsh_agent, *mpi_args]))


def notebook_side(cluster: HostCluster, body: str, rank_code: str = "",
                  timeout: float = 240, elastic: bool | None = None, transport: str = "auto",
                  mpi_args: tuple[str, ...] = ()) -> dict:
    """Run ``body`` on the login host with ``session`` started on both nodes (2 ranks each;
    ``elastic`` and ``transport`` as ``Session`` takes them, ``mpi_args`` added to mpiexec's);
    ``body`` fills the dict ``out``, printed as the last line, and finds ``rank_code`` in
    ``RANK_CODE``."""
    hosts, mpi_args = _placement(cluster, mpi_args)
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


#: The program of :class:`SharedNotebookSide`: one ``Session`` started, then each line of stdin
#: (JSON: a body and its rank code) run as :func:`notebook_side` runs one, until stdin ends.
SERVER = """
import json, sys, traceback
from ipydist import Session
session = Session(**json.loads(sys.argv[1]))
try:
    session.start()
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        out = {}
        try:
            exec(request["body"], {"session": session, "out": out,
                                   "RANK_CODE": request["rank_code"]})
            print("RESULT " + json.dumps(out), flush=True)
        except BaseException:
            print("FAILED " + json.dumps(traceback.format_exc()), flush=True)
finally:
    session.stop(quiet=True)
print("STOPPED", flush=True)
"""


class SharedNotebookSide:
    """A notebook side on the login host whose ``Session`` (2 ranks on each node) lives across
    tests, as a notebook's does across cells: :meth:`run` runs a body as :func:`notebook_side`
    does, on the same cluster. For the tests whose subject is not the start or the end: each
    start across hosts costs the CPU of four ranks importing torch and of ssh (issue 46)."""

    def __init__(self, cluster: HostCluster, timeout: float = 180) -> None:
        hosts, mpi_args = _placement(cluster)
        options = json.dumps({"hosts": hosts, "mpi_args": mpi_args, "timeout": 180})
        self.proc = cluster.popen("login", [sys.executable, "-c", SERVER, options],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="login-side-reader").start()
        self.started = self._until(("READY",), timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _until(self, marks: tuple[str, ...], timeout: float) -> str:
        """The output up to and with the first line that starts with one of ``marks``."""
        text, deadline = "", time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no {marks} within {timeout:g} s:\n{text[-3000:]}") from None
            if line is None:
                raise AssertionError(f"the notebook side ended (exit {self.proc.wait()}) "
                                     f"before {marks}:\n{text[-3000:]}")
            text += line
            if line.startswith(marks):
                return text

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, body: str, rank_code: str = "", timeout: float = 240) -> dict:
        """``body`` run with ``session`` and ``RANK_CODE`` = ``rank_code``; ``out`` as it
        filled it, with ``_stdout``: what the start printed, then what the body did."""
        self.proc.stdin.write(json.dumps({"body": textwrap.dedent(body),
                                          "rank_code": textwrap.dedent(rank_code)}) + "\n")
        self.proc.stdin.flush()
        text = self._until(("RESULT ", "FAILED "), timeout)
        last = text.splitlines()[-1]
        assert last.startswith("RESULT "), json.loads(last[len("FAILED "):]) + text[-3000:]
        return {**json.loads(last[len("RESULT "):]), "_stdout": self.started + text}

    def stop(self, timeout: float = 60) -> str:
        """End the session (stdin closed) and the program; what it printed meanwhile."""
        try:
            self.proc.stdin.close()
            return self._until(("STOPPED",), timeout)
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
