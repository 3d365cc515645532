"""IPython magics: argument parsing and printing only; the work is done by :class:`Session`."""

from __future__ import annotations

import argparse
import functools
import os
import sys

import IPython.core.page
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ipydist import protocol
from ipydist.errors import IpydistError, NotDefined, RankTimeout, shows_itself
from ipydist.notebook import expected_errors, words
from ipydist.notebook.introspection import completion, debugging
from ipydist.notebook.live import cluster_view
from ipydist.notebook.start_options import options_of, start_options
from ipydist.session import Session
from ipydist.specs import SpecError, format_ranks, parse_np

#: Marks a cell that ``%dist_mode everyrank`` turned into an ``%%everyrank`` cell.
_MODE_FLAG = "--from-mode"


class RankValue:
    """A rank's last expression, shown as the cell's ``Out`` with its rich representations."""

    def __init__(self, bundle: dict):
        self.data = bundle.get("data", {})
        self.metadata = bundle.get("metadata", {})

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self) -> str:
        return self.data.get("text/plain", "")


#: The words that ask a magic for its options instead of running it.
_HELP = ("-h", "--help")


def _as_magic(method):
    """``method`` as the user meets it: ``-h``/``--help`` print its options (IPython's magic
    parsers have none), and an error of ipydist's is a one-line ``UsageError`` unless it
    shows itself (a rank's traceback, a dead rank's message): the one place magics
    translate errors."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        line = args[0] if args else kwargs.get("line", "")
        if getattr(method, "parser", None) is None and line.strip() in _HELP:  # no options
            return _show_help(method)
        try:
            return method(*args, **kwargs)
        except _HelpShown:
            return None
        except IpydistError as e:
            if shows_itself(e):
                raise
            raise UsageError(str(e)) from None

    return run


class _HelpShown(Exception):
    """``--help`` was given and the options printed: the magic does nothing else."""


class _HelpAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show this help (the options) and do nothing else")

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help())
        raise _HelpShown


def _show_help(method) -> None:
    parser = getattr(method, "parser", None)
    print(parser.format_help() if parser is not None else (method.__doc__ or "").strip())


def _with_help(magics_class):
    """Give each magic parser of ``magics_class`` a ``-h``/``--help`` option (once: the
    parsers belong to the class's functions)."""
    for function in vars(magics_class).values():
        parser = getattr(function, "parser", None)
        if parser is not None:
            try:
                parser.add_argument("-h", "--help", action=_HelpAction)
            except argparse.ArgumentError:  # given already (a second class of the same magics)
                pass
    return magics_class


@_with_help
@magics_class
class DistMagics(Magics):
    """``%dist_start``, ``%%everyrank`` and friends, over one :class:`Session` per shell."""

    session: Session | None = None
    #: "everyrank" while ``%dist_mode everyrank`` sends every cell to the ranks.
    mode = "local"

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        #: Ranks to start on first use, in a kernel installed with ``install-kernel --np N``.
        self.kernel_np = kernel_np()
        # every magic: --help, ipydist's errors as usage errors, and in a cell tagged
        # raises-exception, an error is shown and Run All goes on
        for registered in self.magics.values():
            for name, method in registered.items():
                registered[name] = expected_errors.shown_when_expected(_as_magic(method))

    def _session(self) -> Session:
        if self.session is None and self.kernel_np:
            print(f"Starting {self.kernel_np} ranks: this kernel starts them on first use "
                  "(ipydist install-kernel --np).")
            self.dist_start("")
        if self.session is None or not self.session.running:
            raise UsageError(words.MAGICS.no_cluster())
        return self.session

    @start_options
    @line_magic
    def dist_start(self, line: str = ""):
        """Start a cluster of ranks launched by mpiexec (or Slurm), with torch.distributed ready
        on each."""
        args = parse_argstring(self.dist_start, line)
        if self.session is not None and self.session.running:
            raise UsageError(words.MAGICS.already_running(self.session.size))
        session = Session(options_of(args, np=self.kernel_np))
        session.words = words.MAGICS
        session.start()
        self.session = session

    @magic_arguments()
    @argument("--ranks", default=None, metavar="SPEC",
              help="ranks to run on: 0, 0,2 or 1-3 (default: all)")
    @argument("--timeout", type=float, default=None, metavar="S",
              help="interrupt the cell on every rank after S seconds, as the stop button does")
    @argument(
        "--output", default="all", choices=["all", "rank0"],
        help="whose output (printed and rich) to show: every rank's (default), or rank 0's only",
    )
    @argument("--debug-rank", default=None, metavar="SPEC",
              help="where breakpoint() stops at a pdb prompt: 2, 0,2 or 1-3 (default: every "
                   "rank, one at a time); on other ranks it is ignored, with a line saying so")
    @argument("--from-mode", action="store_true", help=argparse.SUPPRESS)
    @line_cell_magic
    def everyrank(self, line: str = "", cell: str | None = None):
        """Run the cell on every rank (or on --ranks); ``%everyrank CODE`` runs one line."""
        if cell is None and line.strip() in _HELP:  # the line form's line is code, but this
            return _show_help(self.everyrank)
        if cell is None:
            code, args = line, parse_argstring(self.everyrank, "")
        else:
            code, args = cell, parse_argstring(self.everyrank, line)
        session = self._session()
        if args.from_mode:  # the output says where the cell ran
            print(f"[%dist_mode everyrank: ranks {format_ranks(range(session.size))}]")
        try:
            result = session.run(code, ranks=args.ranks, timeout=args.timeout,
                                 output=args.output, debug_ranks=args.debug_rank)
        except SyntaxError as e:
            where = f", line {e.lineno}" if e.lineno else ""
            text = f"\n    {e.text.rstrip()}" if e.text else ""
            raise UsageError(f"syntax error in the cell{where}: {e.msg}{text}\nNothing ran.") \
                from None
        for page in result.pages:  # obj? in the cell: the first rank's help, in the pager
            IPython.core.page.page(completion.headed(page, result.ranks[0]))
        return _cell_value(result, args.output)

    @magic_arguments()
    @argument("--rank", type=int, default=None, metavar="R",
              help="the rank to debug (default: the lowest rank that raised in the last cell)")
    @argument("--commands", nargs="+", default=None, metavar="CMD",
              help='pdb commands to run instead of a prompt, then q: --commands "p x" w')
    @line_magic
    def dist_debug(self, line: str = ""):
        """pdb on a rank's last error, at a prompt here (like %debug): q ends it, and the
        rank is left as it was."""
        args = parse_argstring(self.dist_debug, line)
        self._session().debug(args.rank, debugging.unquoted(args.commands))

    @line_magic
    def dist_stack(self, line: str = ""):
        """Where each rank is now, its cell's stack, collapsed where ranks agree (works
        while a cell runs, from a console or subshell of this kernel)."""
        return self._session().stacks()

    @magic_arguments()
    @argument("--live", action="store_true",
              help="a view that updates about once a second: what each rank does (running "
              "cell N, waiting in a collective, at a breakpoint, dead), CPU, memory, GPU, step "
              "time; with interrupt, restart and stop buttons")
    @line_magic
    def dist_status(self, line: str = ""):
        """Show each rank: host, pid, device, alive/busy, memory; --live: a view that
        updates while cells run, with interrupt, restart and stop buttons."""
        args = parse_argstring(self.dist_status, line)
        session = self._session()
        if not args.live:
            return session.status()
        cluster_view.show(session.live_status())
        return None

    @magic_arguments()
    @argument("--np", type=str, required=True, metavar="M",
              help="the number of ranks to grow or shrink to")
    @line_magic
    def dist_scale(self, line: str = ""):
        """Grow or shrink the running (elastic) cluster to M ranks, keeping every rank's
        state: new ranks get rank 0's variables, ranks from M up leave."""
        args = parse_argstring(self.dist_scale, line)
        self._session().scale(args.np)

    @line_magic
    def dist_stop(self, line: str = ""):
        """Stop the cluster: engines, mpiexec and controller all end."""
        if self.mode == "everyrank":
            self._set_mode("local")
            print("Cells run in the notebook again (%dist_mode local).")
        if self.session is None or not self.session.running:
            print("No cluster is running.")
            return
        self.session.stop()

    @magic_arguments()
    @argument(
        "mode", choices=["everyrank", "local"],
        help="everyrank: every following cell runs on all ranks, as if it began with "
        "%%%%everyrank (cells that begin with an ipydist magic still run here); local: cells "
        "run in the notebook again",
    )
    @line_magic
    def dist_mode(self, line: str = ""):
        """Run every following cell on all ranks without typing %%everyrank, or stop doing so."""
        args = parse_argstring(self.dist_mode, line)
        if args.mode == "everyrank":
            session = self._session()
            self._set_mode("everyrank")
            print(f"Every cell now runs on ranks {format_ranks(range(session.size))}, until "
                  "%dist_mode local.")
        else:
            was = self.mode
            self._set_mode("local")
            print("Cells run in the notebook again." if was == "everyrank" else
                  "Cells already run in the notebook.")

    def _user_shell(self) -> InteractiveShell:
        """The shell the magics were registered with (IPython types it as optional)."""
        assert self.shell is not None, "DistMagics is used without a shell"
        return self.shell

    def _set_mode(self, mode: str) -> None:
        transforms = self._user_shell().input_transformers_cleanup
        if self._to_everyrank in transforms:
            transforms.remove(self._to_everyrank)
        if mode == "everyrank":
            transforms.append(self._to_everyrank)
        self.mode = mode

    def _to_everyrank(self, lines: list[str]) -> list[str]:
        """Input transformer of ``%dist_mode everyrank``: the cell becomes an ``%%everyrank``
        cell, unless it is empty or begins with one of ipydist's magics."""
        first = next((line.strip() for line in lines if line.strip()), "")
        if not first or first.startswith(completion.RUN_HERE):
            return lines
        return [f"%%everyrank {_MODE_FLAG}\n", *lines]

    @line_magic
    def dist_restart(self, line: str = ""):
        """Stop the cluster and start a fresh one with the same arguments."""
        if self.session is None:
            raise UsageError("no cluster was started yet: use %dist_start --np N.")
        self.session.restart()

    @magic_arguments()
    @argument("--start", action="store_true",
              help="start recording every rank's collectives afresh (hvd.start_timeline)")
    @argument("--stop", action="store_true", help="show what was recorded and stop recording")
    @argument("--out", default=None, metavar="PATH",
              help=f"where to write the Chrome trace (default: {protocol.TIMELINE_FILE})")
    @line_magic
    def dist_timeline(self, line: str = ""):
        """Show every rank's collectives recorded so far (a bar per collective, its call
        check apart) and write them as one Chrome trace."""
        args = parse_argstring(self.dist_timeline, line)
        if args.start and args.stop:
            raise UsageError("--start and --stop: choose one")
        action = "start" if args.start else "stop" if args.stop else "show"
        try:
            shown = self._session().timeline(action, args.out or protocol.TIMELINE_FILE)
        except RankTimeout as e:
            raise RankTimeout(f"{e}: wait for the running cell to end, then try again") \
                from None
        if action == "start":
            print("Recording every rank's collectives: %dist_timeline shows them.")
            return None
        if shown.empty:
            print("No collectives recorded: start with %dist_timeline --start (or "
                  "hvd.start_timeline(path) in an %%everyrank cell), then run some.")
            return None
        return shown

    @magic_arguments()
    @argument("name", help="the variable to fetch")
    @argument("--rank", type=int, default=None, metavar="R", help="fetch from this rank only")
    @line_magic
    def dist_pull(self, line: str = ""):
        """The value of NAME on every rank, as a list in rank order (or on one rank)."""
        args = parse_argstring(self.dist_pull, line)
        return self._session().pull(args.name, rank=args.rank)

    @magic_arguments()
    @argument("names", nargs="+", help="notebook variables to send to every rank")
    @line_magic
    def dist_push(self, line: str = ""):
        """Send notebook variables to every rank, under the same names."""
        args = parse_argstring(self.dist_push, line)
        session = self._session()
        user_ns = self._user_shell().user_ns
        missing = [n for n in args.names if n not in user_ns]
        if missing:
            raise NotDefined(f"not defined in the notebook: {', '.join(missing)}")
        session.push(**{n: user_ns[n] for n in args.names})


def kernel_np(environ=None) -> int | None:
    """The ranks this kernel starts on first use (``install-kernel --np N``), if any."""
    value = (environ if environ is not None else os.environ).get(protocol.KERNEL_NP_ENV, "")
    if not value:
        return None
    try:
        return parse_np(value)
    except SpecError:
        print(f"ipydist: ignoring {protocol.KERNEL_NP_ENV}={value!r}: not a number of ranks.",
              file=sys.stderr)
        return None


def _cell_value(result, output: str):
    """Rank 0's last expression as ``Out``; when ranks disagree, every rank's, tagged."""
    values = result.execute_results
    if not values:
        return None
    first = result.ranks[0]
    texts = {r: v.get("data", {}).get("text/plain", "") for r, v in values.items()}
    if output == "rank0" or len(set(texts.values())) == 1:
        return RankValue(values[first]) if first in values else None
    for r in sorted(texts):
        print(f"[rank {r}] Out: {texts[r]}")
    return None
