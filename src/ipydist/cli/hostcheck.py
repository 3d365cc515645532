"""``ipydist doctor --hosts ...``: what each other host needs before ranks can run there.

Each host is asked over ssh, the way mpiexec will reach it (the ssh command Open MPI is told
to use, ``PRTE_MCA_plm_ssh_agent`` or Open MPI 4's names, else plain ``ssh``, never
prompting): is it reachable; does it run the same Python and ipydist at the same path (a
shared filesystem, or the same environment installed alike); is the same mpiexec there; how
many GPUs it has; and can it open a connection to the notebook host's address that reaches it,
which is what the ranks do to reach the controller (a firewall in between shows here, not as a
start that times out).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time

from ipydist.cli.checks import FAIL, NOTE, OK, Check
from ipydist.errors import LaunchError
from ipydist.notebook.launch.hosts import choose
from ipydist.specs import SpecError

#: Seconds for one host to answer all its checks.
HOST_TIMEOUT = 30

#: Run on the other host with this host's Python path; prints one JSON line.
_PROBE = r"""
import json, os, shutil, socket, subprocess, sys
out = {"python": sys.version.split()[0], "host": socket.gethostname()}
try:
    from importlib import metadata
    out["ipydist"] = metadata.version("ipydist")
except Exception as e:
    out["ipydist"] = None
out["mpiexec"] = os.path.exists(sys.argv[1])
smi = shutil.which("nvidia-smi")
text = ""
try:
    if smi:
        text = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
except Exception:
    pass
out["gpus"] = sum(1 for line in text.splitlines() if line.startswith("GPU "))
try:
    with socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=5):
        out["reaches"] = True
except OSError as e:
    out["reaches"] = str(e)
print(json.dumps(out))
"""


#: The variables that give mpiexec another ssh command, in the order it reads them: PRRTE's
#: (Open MPI 5's launcher), then Open MPI 4's names, which Open MPI 5 still takes.
SSH_AGENT_VARIABLES = ("PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_ssh_agent",
                       "OMPI_MCA_plm_rsh_agent")


def ssh_command() -> list[str]:
    """How mpiexec reaches other hosts: the ssh agent its environment names, else ssh."""
    agent = next((os.environ[v] for v in SSH_AGENT_VARIABLES if os.environ.get(v)), "ssh")
    return [*shlex.split(agent), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


def check_hosts(spec: str, mpiexec_path: str) -> list[Check]:
    """One :class:`Check` per host named by ``spec`` (``--hosts`` syntax), plus one for the
    way there; a spec naming only this host gives a note."""
    try:
        named = choose(hosts=spec, env={})
    except (SpecError, LaunchError) as e:
        return [Check(FAIL, "hosts", str(e), "name hosts this host can resolve and reach.")]
    assert named is not None  # a --hosts spec names hosts
    if named.route is None:
        return [Check(NOTE, "hosts", f"{spec}: only this host; nothing to check over ssh")]
    checks = [Check(OK, "network", f"the notebook reaches the hosts from {named.route}")]
    with socket.create_server((named.route.address, 0)) as listener:
        port = listener.getsockname()[1]
        listener.settimeout(0.1)
        for name, _ in named.hosts:
            checks.append(_check_one(name, mpiexec_path, named.route.address, port, listener))
    return checks


def _check_one(host: str, mpiexec_path: str, address: str, port: int, listener) -> Check:
    argv = [*ssh_command(), host, shlex.join(
        [sys.executable, "-c", _PROBE, mpiexec_path, address, str(port)])]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
    except OSError as e:
        return Check(FAIL, host, f"cannot run {argv[0]} ({e})", "install an ssh client.")
    try:
        stdout, stderr = _communicate(proc, listener)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Check(FAIL, host, f"did not answer within {HOST_TIMEOUT} s", "check ssh to it.")
    if proc.returncode != 0 or not stdout.strip():
        said = (stderr.strip().splitlines() or ["no output"])[-1]
        if proc.returncode == 255:
            return Check(FAIL, host, f"ssh failed: {said}", _ssh_fix(said))
        return Check(FAIL, host, f"{sys.executable} failed there: {said}",
                     "install the same environment at the same path on every host "
                     "(or share it over a network filesystem).")
    return _judge(host, json.loads(stdout.strip().splitlines()[-1]))


#: What ssh's last words mean, and what to do about them.
_SSH_FIXES = [
    (("Connection refused",), "nothing answers ssh there: start sshd on it (port 22, or the "
                              "port your ssh config names)."),
    (("Could not resolve", "Name or service not known"), "check the host name (getent hosts)."),
    (("No route to host", "timed out", "Network is unreachable"),
     "the host is down or a firewall is in the way: check that it is up and TCP reaches it."),
    (("Host key verification failed",), "add the host's key to known_hosts (ssh to it once)."),
]


def _ssh_fix(said: str) -> str:
    for signs, fix in _SSH_FIXES:
        if any(sign in said for sign in signs):
            return fix
    return "set up key-based ssh to it (ssh-copy-id), with no prompt."


def _communicate(proc, listener) -> tuple[str, str]:
    """Wait for the probe, accepting (and closing) its test connection meanwhile."""
    deadline = time.monotonic() + HOST_TIMEOUT
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, HOST_TIMEOUT)
        try:
            conn, _ = listener.accept()
            conn.close()
        except (TimeoutError, OSError):
            pass
    return proc.communicate()


def _judge(host: str, found: dict) -> Check:
    from importlib import metadata

    mine = {"python": sys.version.split()[0], "ipydist": metadata.version("ipydist")}
    problems = [f"{what} {found.get(what)} (here {mine[what]})"
                for what in ("python", "ipydist") if found.get(what) != mine[what]]
    if problems:
        return Check(FAIL, host, "different " + ", ".join(problems),
                     "install the same versions on every host.")
    if not found.get("mpiexec"):
        return Check(FAIL, host, "has no mpiexec at the path this host uses",
                     "install the same MPI at the same path on every host.")
    if found.get("reaches") is not True:
        return Check(FAIL, host, f"cannot connect back to the notebook host ({found['reaches']})",
                     "open the firewall between the hosts for TCP.")
    gpus = found.get("gpus") or 0
    return Check(OK, host, f"{found.get('host')}: Python {found['python']}, ipydist "
                           f"{found['ipydist']}, mpiexec, {gpus} GPU(s), reaches the notebook")
