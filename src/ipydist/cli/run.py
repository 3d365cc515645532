"""``ipydist run``: execute a notebook headless, the way Jupyter would, and save the executed copy.

A fresh ``python3`` kernel runs the cells in order in the notebook's folder; ``--np`` rewrites its
``%dist_start`` lines first. The executed copy is written even when a cell fails, and the failure
is reported as one :class:`~ipydist.cli.errors.CliError` naming the cell. ``ipydist demo`` runs
the quickstart through :func:`run_notebook` too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ipydist.cli.errors import CliError

DEFAULT_CELL_TIMEOUT = 600.0
KERNEL_NAME = "python3"

_NP_OPTION = re.compile(r"--np(?:\s*=\s*|\s+)\S+")


#: What nbclient says when the kernel died before it answered at all: nothing has run yet.
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"


def execute_starting_again(make_client) -> None:
    """``make_client().execute()``, with one more start of a fresh kernel when the first died
    before it answered. jupyter_client picks the kernel's ports free and the kernel binds them
    a moment later: another process can take one in between ("Address already in use", once
    in the tests, beside a second worker starting clusters). No cell has run then, so a second
    start, with ports of its own, repeats nothing."""
    try:
        make_client().execute()
    except RuntimeError as e:
        if KERNEL_DIED_AT_START not in str(e):
            raise
        make_client().execute()


def default_output(notebook: Path) -> Path:
    """``<notebook dir>/executed/<name>``: next to the source, and ignored by git."""
    return notebook.parent / "executed" / notebook.name


def set_np(nb, np: int) -> int:
    """Make every ``%dist_start`` line in the code cells start ``np`` ranks; return how many.

    Lets one notebook, written for 4 ranks, be run with as many ranks as the machine has,
    without editing it. A ``%dist_start`` without ``--np`` gets one appended.
    """
    changed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = cell.source.split("\n")
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("%dist_start"):
                continue
            if _NP_OPTION.search(line):
                lines[i] = _NP_OPTION.sub(f"--np {np}", line, count=1)
            else:
                lines[i] = f"{line.rstrip()} --np {np}"
            changed += 1
        cell.source = "\n".join(lines)
    return changed


def run_notebook(
    notebook: str | Path,
    np: int | None = None,
    output: str | Path | None = None,
    timeout: float = DEFAULT_CELL_TIMEOUT,
) -> Path:
    """Execute ``notebook`` in a fresh kernel and write the executed copy; return its path.

    The copy is written even when a cell fails, so its outputs show what went wrong; the
    failure is then raised as a :class:`CliError` naming the cell and the error.
    """
    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    notebook = Path(notebook)
    if not notebook.is_file():
        raise CliError(f"{notebook}: no such notebook.")
    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as e:  # nbformat raises several kinds for a file that is not a notebook
        raise CliError(f"{notebook}: not a readable notebook ({e}).") from None
    if np is not None and not set_np(nb, np):
        print(f"ipydist: {notebook} has no %dist_start line; --np {np} has no effect.",
              file=sys.stderr)
    out = Path(output) if output is not None else default_output(notebook)
    def client() -> NotebookClient:
        return NotebookClient(
            nb,
            timeout=timeout,
            # On a timeout, interrupt rather than kill: %%everyrank passes the interrupt on to
            # the ranks, and the then idle kernel shuts down cleanly, stopping its cluster as it
            # exits.
            interrupt_on_timeout=True,
            kernel_name=KERNEL_NAME,
            resources={"metadata": {"path": str(notebook.resolve().parent)}},
            config=_kernel_config(),
        )

    failure = None
    try:
        execute_starting_again(client)
    except CellExecutionError as e:
        if e.ename == "KeyboardInterrupt":
            failure = f"{_running_cell(nb)} ran past the cell timeout of {timeout:g} s."
        else:
            failure = f"{_running_cell(nb)} failed: {_one_line(e.ename, e.evalue)}"
    except CellTimeoutError:
        failure = f"{_running_cell(nb)} ran past the cell timeout of {timeout:g} s."
    except DeadKernelError:
        failure = f"the kernel died while running {_running_cell(nb)}."
    except NoSuchKernel:
        failure = (f"no Jupyter kernel named {KERNEL_NAME!r}: install ipykernel in this "
                   "environment (pip install ipykernel).")
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
    if failure is not None:
        raise CliError(f"{notebook}: {failure.rstrip('.')} (executed copy: {out})")
    return out


def _kernel_config():
    """Encrypt the kernel's channels when the kernel supports it (and quiet its warning)."""
    import zmq
    from traitlets.config import Config

    if zmq.has("curve"):
        return Config({"KernelManager": {"transport_encryption": "auto"}})
    return Config()


def _one_line(ename: str, evalue: str) -> str:
    """``Name: message`` (a traceback's last line), cut to the message's first line."""
    first = (evalue or "").strip().splitlines()
    return f"{ename}: {first[0]}" if first else ename


def _describe(index: int, cell) -> str:
    head = cell.source.strip().split("\n", 1)[0]
    if len(head) > 40:
        head = head[:37] + "..."
    return f"cell {index + 1} ({head})" if head else f"cell {index + 1}"


def _running_cell(nb) -> str:
    """The last code cell that started (nbclient sets execution_count when a cell starts): the
    one that failed or timed out, since execution stops there. (Not the first cell with an
    error output: a cell tagged ``raises-exception`` may have one, and a UsageError has none.)"""
    started = [
        (i, c) for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and c.get("execution_count") is not None
    ]
    return _describe(*started[-1]) if started else "the first cell"
