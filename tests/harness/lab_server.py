"""JupyterLab (and Notebook 7, which the same server serves) in a real browser, for the tests in
tests/browser: a server started per test in its own process group with quiet settings, stopped
with everything it started; a Chromium page whose console is kept, and whose page errors fail
the test; and the few things a person does (open a notebook, Run All, read the prompts).

Needs ``/usr/bin/chromium`` (``scripts/ensure-chromium.sh``; Playwright never downloads a
browser of its own here).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers import CHROMIUM, CHROMIUM_ARGS, MARK_VAR, cluster_processes, kill_left, new_mark

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


# ---------------------------------------------------------------------------------- the server


@dataclass
class Lab:
    """A JupyterLab server started for one test, in its own process group."""

    proc: subprocess.Popen
    port: int
    token: str
    mark: str
    log: Path
    root: Path
    env: dict

    def trust(self, path: Path) -> None:
        """Sign the notebook at ``path`` as the person's own, as ``jupyter trust`` does, in
        this server's signature store (the test's, never the user's)."""
        trust(self.root, path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}?token={self.token}"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def processes(self, marked: bool = True) -> dict[int, str]:
        """pid -> cmdline of every process this server started (kernel, controller, mpiexec,
        engines): its descendants, plus (``marked``) anything carrying this run's environment
        mark, which costs a look at every process on the machine."""
        found = cluster_processes(self.mark) if marked else {}
        found.pop(self.proc.pid, None)
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                found[p.pid] = cmdline(p)
        except psutil.Error:
            pass
        return found


def notary(root: Path):
    """The notebook signatures of the server serving ``root``: beside it, not the user's."""
    from nbformat.sign import NotebookNotary

    return NotebookNotary(db_file=str(root.parent / "nbsignatures.db"),
                          secret_file=str(root.parent / "notebook_secret"))


def trust(root: Path, path: Path) -> None:
    """Sign the notebook at ``path`` in the signatures of the server serving ``root``."""
    import nbformat

    notary(root).sign(nbformat.read(path, as_version=4))


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_without_outputs(src: Path, dst: Path) -> None:
    """The notebook with its outputs cleared, so that a chart saved in it is never mistaken for
    the live one."""
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))


def write_lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, test-friendly JupyterLab.

    No news or update prompt (its toast would cover the notebook and it tries the network), and
    every cell kept in the page (the default windowing detaches or skips rendering off-screen
    cells, and the test finds the training cell by its index).
    """
    settings = {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # Widget state saved with the notebook (JupyterLab's default is not to): the test of
        # a reopened notebook checks both ways, removing the saved state for the second.
        "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
    }
    for name, values in settings.items():
        path = settings_dir / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def wait_until_serving(lab: Lab, timeout: float = 60.0) -> bool:
    """Wait until the server answers its REST API: True. False where it ended because another
    process took its port between :func:`free_port` and its start (it is told not to try
    another port, where the test would not find it); fail with its log if it dies otherwise
    or never answers. Until it answers, whatever else holds the port (a kernel's ZeroMQ socket
    answers HTTP with bytes that are not a status line) is waited out too."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        f"http://127.0.0.1:{lab.port}/api/status",
        headers={"Authorization": f"token {lab.token}"},
    )
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            if f"The port {lab.port} is already in use" in lab.log.read_text(errors="replace"):
                return False
            pytest.fail(f"jupyter lab exited with {lab.proc.returncode}:\n{lab.log_tail()}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            pass
        time.sleep(0.25)
    pytest.fail(f"jupyter lab did not answer within {timeout:.0f} s:\n{lab.log_tail()}")


def stop_lab(lab: Lab) -> None:
    """SIGTERM to the server's process group (it then shuts its kernels down), SIGKILL if it
    has not ended after a few seconds."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(lab.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            lab.proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


#: The server extensions and labextensions of server-side execution (the ``durable`` extra),
#: installed in the test venv and switched on only for the servers that test it.
DURABLE_SERVER_EXTENSIONS = ["jupyter_server_nbmodel", "jupyter_server_ydoc",
                             "jupyter_server_fileid"]
DURABLE_LABEXTENSIONS = ["@datalayer/jupyter-server-nbmodel", "@jupyter/collaboration-extension",
                         "@jupyter/docprovider-extension"]


def write_server_config(config_dir: Path, durable: bool) -> None:
    """The per-test Jupyter config: server-side execution (jupyter-server-nbmodel with
    jupyter-collaboration) off unless ``durable``, as a person who did not install the extra
    has it. (Disabled labextensions also drop the core plugins they would replace.)"""
    if durable:
        return
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": dict.fromkeys(DURABLE_SERVER_EXTENSIONS, False)}}))
    (config_dir / "labconfig").mkdir(exist_ok=True)
    (config_dir / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": dict.fromkeys(DURABLE_LABEXTENSIONS, True)}))


@contextlib.contextmanager
def serve(tmp_path: Path, notebooks: dict, durable: bool = False, trusted: tuple = (),
          python: Path | None = None):
    """JupyterLab serving ``notebooks`` (file name -> a notebook's path, copied without its
    outputs, or an nbformat notebook); on leaving, stopped with everything it started, and an
    AssertionError if anything had to be killed.

    ``durable``: with server-side execution (jupyter-server-nbmodel, jupyter-collaboration);
    ``trusted``: the names of the notebooks signed as the person's own (the server's
    signature store is the test's, never the user's); ``python``: the environment's Python
    that runs JupyterLab (and so its kernels), the test venv's by default."""
    import nbformat

    root = tmp_path / "root"
    root.mkdir()
    for name, notebook in notebooks.items():
        if isinstance(notebook, Path):
            copy_without_outputs(notebook, root / name)
        else:
            nbformat.write(notebook, root / name)
    write_lab_settings(tmp_path / "settings")
    write_server_config(tmp_path / "config", durable)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), PYTHONUNBUFFERED="1")
    env[MARK_VAR] = mark = new_mark()
    token = secrets.token_hex(16)
    log = tmp_path / "jupyter-lab.log"
    for name in trusted:
        trust(root, root / name)
    signatures = notary(root)
    for _ in range(3):  # a port another process took meanwhile: again, on another
        server = _start_lab(tmp_path, root, env, mark, token, log, signatures,
                            python or Path(sys.executable))
        if wait_until_serving(server):
            break
    else:
        pytest.fail(f"jupyter lab found its port taken 3 times:\n{server.log_tail()}")
    try:
        yield server
    finally:
        started = server.processes()
        stop_lab(server)
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"{tmp_path.name}.jupyter.log").write_bytes(log.read_bytes())
        left_cmds = kill_left(started, timeout=10)
        assert not left_cmds, f"still running 10 s after JupyterLab stopped (killed): {left_cmds}"


def _start_lab(tmp_path: Path, root: Path, env: dict, mark: str, token: str, log: Path,
               signatures, python: Path) -> Lab:
    """``jupyter lab`` on a free port, in its own process group, told to use that port or
    end (not to try the next: the test would not know it)."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.extension_manager=readonly",
             f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
             f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
             f"--NotebookNotary.db_file={signatures.db_file}",
             f"--NotebookNotary.secret_file={signatures.secret_file}"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return Lab(proc, port, token, mark, log, root, env)


#: Skips a browser test where Debian's chromium is missing.
NEEDS_CHROMIUM = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (make test does)",
)


def docs_screenshot(element, name: str, docs_name: str) -> None:
    """A screenshot of ``element`` in test-artifacts/``name``, copied to docs/``docs_name``
    with ``IPYDIST_UPDATE_SCREENSHOT=1`` (the pictures the docs show)."""
    import shutil

    ARTIFACTS.mkdir(exist_ok=True)
    element.screenshot(path=str(ARTIFACTS / name))
    if os.environ.get("IPYDIST_UPDATE_SCREENSHOT"):
        shutil.copy(ARTIFACTS / name, REPO / "docs" / docs_name)


def notebook_of(cells: list[str]):
    """A notebook of these code cells, with the quickstart's kernel."""
    import nbformat

    quickstart = REPO / "notebooks" / "01-quickstart.ipynb"
    kernel = json.loads(quickstart.read_text())["metadata"]["kernelspec"]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells],
                                    metadata={"kernelspec": kernel})


# ------------------------------------------------------------------------------------ the page

#: Notebook 7's own page errors (raised in its core bundle, with no extension and no user
#: setting at all: JupyterLab 4.6 with Notebook 7.6): on loading its settings, and on opening
#: a notebook after JupyterLab in the same page; a test in Notebook 7 allows them.
NOTEBOOK7_OWN_ERRORS = [re.compile(
    rf"^pageerror: {message} at (\S+ \()?\S*/static/notebook/notebook_core\.")
    for message in (r"Cannot read properties of undefined \(reading 'schema'\)",
                    r"Command 'filebrowser:open-path' not registered\.")]
#: ipywidgets' console error for each widget output of a notebook saved without widget state
#: (JupyterLab's default): not a fault of the page, and expected only where a test reopens
#: such a notebook (see :func:`browser_page`'s ``allowed``).
WIDGET_STATE_NOT_SAVED = re.compile(r"^error: Error: widget model not found")


def _where(error) -> str:
    """Where a page error was raised: the first frame of its stack."""
    frames = [line.strip() for line in (getattr(error, "stack", "") or "").splitlines()
              if line.strip().startswith("at ")]
    return frames[0] if frames else ""


def page_errors(console: list[str], allowed: list[re.Pattern]) -> list[str]:
    """The page errors (uncaught exceptions) and console errors in ``console``, but those a
    pattern of ``allowed`` matches."""
    return [m for m in console if m.startswith(("pageerror:", "error:"))
            and not any(p.search(m) for p in allowed)]


@contextlib.contextmanager
def browser_page(console: list[str], name: str, allowed: list[re.Pattern]):
    """A Chromium page (1400 x 1400); its console messages and page errors go to ``console``.
    On leaving (passed or failed) a screenshot and the console are saved under
    test-artifacts/ as ``name``.png and ``name``.console.txt, the things one debugs a page
    with; then any page or console error not ``allowed`` fails the test."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1400})
            pg.set_default_timeout(60_000)
            pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"pageerror: {e} {_where(e)}"))
            try:
                yield pg
            finally:
                try:
                    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), timeout=10_000)
                except Exception as e:  # a crashed page must not hide the test's own failure
                    console.append(f"(screenshot failed: {e})")
                (ARTIFACTS / f"{name}.console.txt").write_text("\n".join(console))
        finally:
            browser.close()
    errors = page_errors(console, allowed)
    assert not errors, "errors in the browser's console:\n" + "\n".join(errors[:20])


# ----------------------------------------------------------------------------- what one does

#: True once the status bar reads "<kernel name> | Idle": the kernel has started and answered.
#: (The toolbar's execution indicator says "idle" already before any kernel exists.)
#: True once the kernel has started and answered: JupyterLab's status bar reads
#: "<kernel name> | Idle" (its toolbar's execution indicator says idle already before any
#: kernel exists, and Run All while the kernel still initializes is refused with a notice).
KERNEL_IDLE = """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
    .some((e) => /^(?!No Kernel).+ \\| Idle$/.test(e.textContent.trim()))"""
#: The same in Notebook 7, which has no status bar: its toolbar's indicator starts at
#: "connecting" and says idle once the kernel has answered.
NOTEBOOK7_KERNEL_IDLE = """() => document.querySelector('.jp-Notebook-ExecutionIndicator')
    ?.getAttribute('data-status') === 'idle'"""


def open_notebook(page, lab: Lab, name: str, console: list[str], notebook7: bool = False,
                  workspace: str = ""):
    """Open the notebook in JupyterLab (or Notebook 7) and wait until its kernel has started
    and is idle; ``console`` is the page's (see :func:`browser_page`). ``workspace``: a
    JupyterLab workspace of that name, where the notebooks another page opened are not."""
    where = f"/lab/workspaces/{workspace}" if workspace else "/lab"
    page.goto(lab.url(f"/notebooks/{name}" if notebook7 else f"{where}/tree/{name}"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    deadline = time.monotonic() + 60
    while not any("Starting WebSocket" in m for m in console):
        if time.monotonic() > deadline:
            pytest.fail(f"the page never connected to a kernel:\n{console[-10:]}")
        page.wait_for_timeout(100)  # (not time.sleep: the page's events arrive meanwhile)
    page.wait_for_function(NOTEBOOK7_KERNEL_IDLE if notebook7 else KERNEL_IDLE)


def run_all_cells(page) -> None:
    """Run > Run All Cells from the menu bar, as a user would; wait until the run has begun."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt')]
            .some((p) => /\\[(\\*|\\d+)\\]/.test(p.textContent))""",
        timeout=15_000,
    )


#: A code cell as the page shows it (``index`` among the notebook's code cells): prompt,
#: output text, and the point count of its metrics chart (null where none rendered).
READ_CELL = """(index) => {
    const cell = document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')[index];
    const widget = cell?.querySelector('.ipydist-metrics');
    return {
        prompt: (cell?.querySelector('.jp-InputPrompt')?.textContent ?? '').trim(),
        text: cell?.querySelector('.jp-OutputArea')?.innerText ?? '',
        points: widget ? Number(widget.dataset.points) : null,
    };
}"""


def wait_for_cell(page, what, timeout: float, describe: str, cell: int = 1) -> dict:
    """Until ``what`` (of :data:`READ_CELL`'s reading) holds for the code cell ``cell``; fail
    saying ``describe`` and what the cell shows after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        now = page.evaluate(READ_CELL, cell)
        if what(now):
            return now
        if time.monotonic() > deadline:
            pytest.fail(f"{describe} within {timeout:.0f} s; the cell shows {now}")
        page.wait_for_timeout(200)


def training_cell(steps: int, stop: Path | None = None) -> str:
    """An ``%%everyrank`` cell that prints ``line N`` and logs a point each second, for
    ``steps`` seconds, then rank 0 prints "done". With ``stop``, every rank ends its loop at
    the step :func:`stop_training` writes there, the same on each: a test that has seen what
    it waits for ends the cell then, and on a slow machine the cell does not end before."""
    check = (f"    if os.path.exists({str(stop)!r}) and i >= int(open({str(stop)!r}).read()):\n"
             "        break\n") if stop else ""
    return ("%%everyrank\nimport os\nimport time\nimport ipydist.torch as hvd\n"
            f"for i in range({steps}):\n"
            f"{check}"
            "    print(f'line {i}', flush=True)\n"
            f"    hvd.log(step=i, total={steps}, loss=1.0 / (i + 1))\n"
            "    time.sleep(1)\n"
            "if hvd.rank() == 0:\n"
            "    print('done')")


def stop_training(page, stop: Path, cell: int = 1) -> int:
    """End the :func:`training_cell` with ``stop`` that code cell ``cell`` runs, 5 steps (5 s)
    after the last line the page shows: the ranks are not that far past it, even where the
    page lags on a loaded machine, so each stops at that step. The number of lines it prints
    in all. Written whole, then renamed: a rank never reads half of it."""
    shown = max(printed_lines(page.evaluate(READ_CELL, cell)["text"]), default=0)
    steps = shown + 5
    partial = stop.with_suffix(".partial")
    partial.write_text(str(steps))
    partial.rename(stop)
    return steps


def printed_lines(text: str) -> list[int]:
    """The numbers of the ``line N`` lines a training cell's ranks printed, as shown (each
    once: merged, or rank 0's copy where the ranks' came apart, as on a loaded machine)."""
    return [int(n) for n in re.findall(r"^\[(?:all ranks|rank 0)\] line (\d+)$", text, re.M)]


def leave_and_come_back(page, lab: Lab, name: str, console: list[str] | None = None,
                        away: float = 8) -> tuple[dict, float, float]:
    """The laptop closes while the notebook's training cell (code cell 1, printing ``line N``
    and logging a point each second) runs: the page leaves for ``away`` seconds, and a new one
    opens the notebook. Checks what that page must show: within 15 s the lines printed
    meanwhile, in order, with ``[*]``; the chart with the points so far, then growing.
    ``console``: cleared while no page is there. Returns the cell as first caught up, the
    seconds away and the seconds from the page opening to the lines caught up."""
    before = wait_for_cell(page, lambda r: len(printed_lines(r["text"])) >= 3 and r["points"],
                           180, "the training cell did not print 3 lines and show its chart")
    page.goto("about:blank")  # the page and its websocket are gone
    left = time.monotonic()
    time.sleep(away)
    if console is not None:
        console.clear()
    page.goto(lab.url(f"/lab/tree/{name}"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    reopened = time.monotonic()
    back = wait_for_cell(
        page, lambda r: r["prompt"].startswith("[*]")
        and max(printed_lines(r["text"]), default=0) >= printed_lines(before["text"])[-1] + 8,
        15, "the reopened page did not show the lines printed while away")
    caught_up = time.monotonic() - reopened
    lines = printed_lines(back["text"])
    assert lines == list(range(len(lines))), f"lines out of order or missing: {lines}"
    chart = wait_for_cell(page, lambda r: r["points"] and r["points"] >= 5, 15,
                          "the reopened page's chart did not show the points logged so far")
    wait_for_cell(page, lambda r: r["points"] > chart["points"] + 1, 15,
                  "the reopened page's chart did not grow live")
    return back, reopened - left, caught_up


def ran(prompt: str) -> bool:
    return re.fullmatch(r"\[\d+\]:?", prompt) is not None


def running(prompt: str) -> bool:
    """Queued or running: JupyterLab shows both as ``[*]``."""
    return prompt.startswith("[*]")


def end_sessions(lab: Lab) -> None:
    """Shut down every kernel, as closing JupyterLab and coming back another day does."""
    def call(method, path):
        request = urllib.request.Request(
            f"http://127.0.0.1:{lab.port}{path}", method=method,
            headers={"Authorization": f"token {lab.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    for session in call("GET", "/api/sessions"):
        call("DELETE", f"/api/sessions/{session['id']}")
