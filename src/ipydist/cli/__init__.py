"""The ``ipydist`` command: run notebooks headless, and the one-command demo.

``ipydist run NOTEBOOK`` executes a notebook the way Jupyter would (a fresh ``python3`` kernel,
cells in order, working directory next to the notebook) and saves the executed copy, so the
notebooks in ``notebooks/`` double as end-to-end tests and as something to read afterwards.
``ipydist demo`` runs the quickstart that way and prints the accuracy it reached.

Each subcommand is a pair: ``_add_<name>(subparsers)`` declares its arguments and sets
``handler``; the handler takes the parsed arguments and raises :class:`CliError` on failure.
Adding one means writing that pair and listing it in :data:`_COMMANDS`. The work of ``run`` is
in :mod:`ipydist.cli.run`, that of ``install-kernel``/``uninstall-kernel`` in
:mod:`ipydist.cli.kernelspec`, that of ``doctor`` in :mod:`ipydist.cli.doctor`.
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
from ipydist.cli.errors import CliError
from ipydist.cli.run import DEFAULT_CELL_TIMEOUT, run_notebook
from ipydist.cli.run import set_np as set_np  # re-exported: cli.set_np as before the move
from ipydist.specs import SpecError, parse_np

QUICKSTART = "01-quickstart.ipynb"

_ACCURACY_LINE = re.compile(r"^(?:\[[^\]]*\]\s*)?(final test accuracy:\s*\S+)", re.MULTILINE)


# --- the demo ------------------------------------------------------------------------------


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
