"""The ``ipydist`` command: run notebooks headless, and the one-command demo.

``ipydist run NOTEBOOK`` executes a notebook the way Jupyter would (a fresh ``python3`` kernel,
cells in order, working directory next to the notebook) and saves the executed copy, so the
notebooks in ``notebooks/`` double as end-to-end tests and as something to read afterwards.
``ipydist demo`` runs the quickstart that way and prints the accuracy it reached.

Each subcommand is a pair: ``_add_<name>(subparsers)`` declares its arguments and sets
``handler``; the handler takes the parsed arguments and raises :class:`CliError` on failure.
Adding one means writing that pair and listing it in :data:`_COMMANDS`. The work of
``install-kernel``/``uninstall-kernel`` is in :mod:`ipydist.cli.kernelspec`, that of ``doctor``
in :mod:`ipydist.cli.doctor`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ipydist._version import __version__
from ipydist.cli import doctor, kernelspec
from ipydist.specs import SpecError, parse_np

QUICKSTART = "01-quickstart.ipynb"
DEFAULT_CELL_TIMEOUT = 600.0
KERNEL_NAME = "python3"

_NP_OPTION = re.compile(r"--np(?:\s*=\s*|\s+)\S+")
_ACCURACY_LINE = re.compile(r"^(?:\[[^\]]*\]\s*)?(final test accuracy:\s*\S+)", re.MULTILINE)


class CliError(Exception):
    """A failure to report as one line (``ipydist <command>: <message>``) and exit code 1."""


# --- running notebooks ---------------------------------------------------------------------


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
    client = NotebookClient(
        nb,
        timeout=timeout,
        # On a timeout, interrupt rather than kill: %%everyrank passes the interrupt on to the
        # ranks, and the then idle kernel shuts down cleanly, stopping its cluster as it exits.
        interrupt_on_timeout=True,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(notebook.resolve().parent)}},
        config=_kernel_config(),
    )
    failure = None
    try:
        client.execute()
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


def find_quickstart() -> Path:
    """The quickstart notebook: under ./notebooks, else in the source checkout ipydist runs from."""
    candidates = [
        Path.cwd() / "notebooks" / QUICKSTART,
        # src/ipydist/cli/__init__.py -> the checkout
        Path(__file__).resolve().parents[3] / "notebooks" / QUICKSTART,
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise CliError(
        f"cannot find notebooks/{QUICKSTART} (looked in the current directory and next to "
        "the ipydist sources); run from a checkout of the ipydist repository."
    )


def accuracy_line(nb_path: Path) -> str | None:
    """The ``final test accuracy: X`` line from an executed notebook's printed output."""
    import nbformat

    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                match = _ACCURACY_LINE.search(o.get("text", ""))
                if match:
                    return match.group(1)
    return None


# --- subcommands ---------------------------------------------------------------------------


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is under it (shorter to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run", help="execute a notebook headless and save the executed copy",
        description="Execute NOTEBOOK in a fresh python3 kernel, cells in order, and write "
        "the executed copy (default: <notebook dir>/executed/<name>).",
    )
    p.add_argument("notebook", type=Path, help="the .ipynb file to run")
    p.add_argument("--np", default=None, metavar="N",
                   help="run %%dist_start with N ranks instead of the notebook's own --np")
    p.add_argument("--output", type=Path, default=None, metavar="PATH",
                   help="where to write the executed copy")
    p.add_argument("--timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S",
                   help="seconds any one cell may run (default: %(default)g)")
    p.set_defaults(handler=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> None:
    out = run_notebook(args.notebook, np=args.np, output=args.output, timeout=args.timeout)
    print(_shown(out))


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo", help="run the quickstart notebook and print the accuracy it reached",
        description=f"Run notebooks/{QUICKSTART}: start the ranks, train an MLP on the "
        "digits data set with gradients averaged by allreduce, stop the ranks.",
    )
    p.add_argument("--np", default=None, metavar="N",
                   help="number of ranks (default: the notebook's, 4)")
    p.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> None:
    notebook = find_quickstart()
    ranks = f"{args.np} ranks" if args.np else "the notebook's ranks"
    print(f"Running {_shown(notebook)} with {ranks}...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = run_notebook(notebook, np=args.np)
    elapsed = time.perf_counter() - t0
    line = accuracy_line(out)
    if line is None:
        raise CliError(f"{_shown(out)} ran, but printed no 'final test accuracy' line.")
    print(f"executed notebook: {_shown(out)} ({elapsed:.1f} s)")
    print(line)


def _add_install_kernel(sub) -> None:
    p = sub.add_parser(
        "install-kernel", help="install the 'Python 3 (ipydist)' Jupyter kernel",
        description="Install a Jupyter kernelspec that starts an ordinary IPython kernel with "
        "ipydist already loaded; with --np N, the first cell that needs ranks starts N. "
        "Without --user, --sys-prefix or --prefix it is installed system-wide, as ipykernel "
        "does.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user only")
    where.add_argument("--sys-prefix", action="store_true",
                       help="install into this Python environment (sys.prefix)")
    where.add_argument("--prefix", default=None, metavar="P",
                       help="install under P/share/jupyter/kernels")
    p.add_argument("--name", default=kernelspec.DEFAULT_NAME,
                   help="the kernelspec's name (default: %(default)s)")
    p.add_argument("--display-name", default=None, metavar="TEXT",
                   help=f"the name shown in Jupyter (default: {kernelspec.DEFAULT_DISPLAY_NAME})")
    p.add_argument("--np", default=None, metavar="N",
                   help="start N ranks on first use (a cell that needs them)")
    p.set_defaults(handler=_cmd_install_kernel)


def _cmd_install_kernel(args: argparse.Namespace) -> None:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        folder = kernelspec.install(args.name, args.display_name, args.np,
                                    user=args.user, prefix=prefix)
    except kernelspec.KernelSpecError as e:
        raise CliError(str(e)) from None
    ranks = f"; it starts {args.np} ranks on first use" if args.np else ""
    print(f"Installed kernelspec {args.name} in {folder}{ranks}.")


def _add_uninstall_kernel(sub) -> None:
    p = sub.add_parser("uninstall-kernel", help="remove a kernelspec install-kernel installed",
                       description="Remove an ipydist kernelspec (never any other kernel).")
    p.add_argument("--name", default=kernelspec.DEFAULT_NAME,
                   help="the kernelspec's name (default: %(default)s)")
    p.set_defaults(handler=_cmd_uninstall_kernel)


def _cmd_uninstall_kernel(args: argparse.Namespace) -> None:
    try:
        folder = kernelspec.uninstall(args.name)
    except kernelspec.KernelSpecError as e:
        raise CliError(str(e)) from None
    print(f"Removed kernelspec {args.name} from {folder}.")


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check the installation, then run one allreduce on 2 ranks",
        description="Check Python, torch and CUDA, GPUs, mpiexec and the MPI library mpi4py "
        "loads, ipyparallel, the widgets and JupyterLab's widget extension, and the ipydist "
        "kernelspec; then start 2 ranks and run one allreduce. Exit code 0 only when "
        "nothing failed.",
    )
    p.add_argument("--np", default=None, metavar="N",
                   help="ranks for the test cluster (default: 2, or one per slot of --hosts)")
    p.add_argument("--hosts", default=None, metavar="SPEC",
                   help="also check these hosts over ssh (nodeA:2,nodeB:2): reachable, same "
                   "Python and ipydist, mpiexec, GPUs, a connection back; the test cluster "
                   "then runs on them")
    p.set_defaults(handler=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace) -> None:
    np = args.np if args.np is not None else (None if args.hosts else 2)
    if not doctor.run(np=np, hosts=args.hosts):
        raise CliError("some checks failed; each FAIL line above says how to fix it.")


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_run, _add_demo, _add_install_kernel, _add_uninstall_kernel, _add_doctor,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ipydist",
        description="Train PyTorch models on many GPUs (or CPU processes) from a notebook.",
    )
    parser.add_argument("--version", action="version", version=f"ipydist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ipydist`` and ``python -m ipydist``; exits non-zero on failure.

    Failures raise ``SystemExit`` rather than return a code, because ``python -m ipydist``
    calls ``main()`` without passing its result to ``sys.exit``.
    """
    args = build_parser().parse_args(None if argv is None else [str(a) for a in argv])
    try:
        if getattr(args, "np", None) is not None:
            args.np = parse_np(args.np)
        args.handler(args)
    except SpecError as e:
        print(f"ipydist {args.command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except CliError as e:
        print(f"ipydist {args.command}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"ipydist {args.command}: interrupted.", file=sys.stderr)
        raise SystemExit(130) from None
    return 0
