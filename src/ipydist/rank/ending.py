"""How a rank's process ends once its engine has stopped: what Python's own exit does that
anyone can see, without tearing the interpreter down.

A rank holds torch, numpy, IPython and the user's objects; Python's exit then clears every
module and collects every object, about half a CPU-second per rank (measured with the modules
a rank imports), on every stop and restart, for nothing: the process is going. So the rank does
what is seen from outside and then leaves with ``os._exit``, as multiprocessing's forked
workers do:

- non-daemon threads are waited for, as Python waits for them;
- ``atexit`` callbacks run (the user's, ``weakref.finalize``'s, multiprocessing's, logging's),
  with the garbage collector's full passes made cheap (objects alive before are set aside);
- every file still open for writing is flushed, as its collection would have done: a cell's
  ``f = open(...); f.write(...)`` without a close loses nothing (the files are those open as
  the callbacks begin: one that a callback opens and leaves open is not);
- MPI is finalized, which mpi4py would do at the very end of Python's exit (its launcher
  counts a rank that left without it as failed), but only on a clean end: Open MPI's finalize
  waits for every rank to reach it, so a rank whose engine failed (its start, say) waited
  there while the others served on, and the start waited out its whole ``--timeout``. Left
  unfinalized, it is a failed rank to its launcher at once, as a crash is;
- stdout and stderr are flushed.

What is not done: objects' ``__del__`` methods beyond these, which Python does not promise to
run at exit either; nor torch's own finalizers that unregister its operators from its
dispatcher, whose work dies with the process (the fork server marks them:
``ipydist.rank.start.forkserver.skip_torch_unregistering``).
"""

from __future__ import annotations

import _io
import atexit
import gc
import io
import os
import sys
import threading


def run_then_exit(main) -> None:
    """Run ``main()`` (the engine), then end the process as above, with the exit code that
    ``main`` gave through ``SystemExit`` (0 when it returned). An exception that escapes is
    printed, as Python prints it, and ends the process with 1."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


def exit_now(code: int) -> None:
    # Python's own exit waits for threads, then runs atexit's callbacks
    # threading._shutdown: CPython's own (not in typeshed), what its exit runs first
    files: list = []
    steps = [threading._shutdown,  # type: ignore[attr-defined]
             lambda: files.extend(_open_files()), _run_exit_callbacks, lambda: _flush(files)]
    if code == 0:
        steps.append(_finalize_mpi)
    for step in steps:
        try:
            step()
        except BaseException:  # the next steps still matter; Python's exit goes on too
            pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:  # sys.__stdout__ can be None (its AttributeError passed)
                stream.flush()
        except Exception:
            pass
    os._exit(code)


def _run_exit_callbacks() -> None:
    """atexit's callbacks, with every object alive now set aside from the garbage collector
    (``gc.freeze``): IPython's callback (the engine's shell clears its namespace) ends with a
    full collection, 0.14 s of a 0.3 s stop in a rank that holds torch, to find nothing but
    what reference counting frees anyway as the namespace is cleared."""
    gc.freeze()  # (never undone: the process ends next, and collects nothing more)
    atexit._run_exitfuncs()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # as Python does with sys.exit("message")
    return 1


#: The C base of every file object (io.IOBase is an ABC on top of it, and its isinstance check
#: took 0.07 s over a rank's 190,000 objects; this one, 0.02 s).
_FILE = getattr(_io, "_IOBase", io.IOBase)
_RAW_FILE = getattr(_io, "_RawIOBase", io.RawIOBase)


def _open_files() -> list:
    """Every buffered or text file object alive, looked for before atexit's callbacks run
    (they freeze the garbage collector, which hides every object from this search). Objects
    the fork server froze before it forked this rank are not searched: it opens no file for
    writing, and they are most of a rank's objects (166,000 with torch imported). The answer
    per type is kept: a rank holds few types and many objects."""
    answers: dict[type, bool] = {}
    found = []
    for obj in gc.get_objects():
        kind = type(obj)
        answer = answers.get(kind)
        if answer is None:
            answer = answers[kind] = issubclass(kind, _FILE) and not issubclass(kind, _RAW_FILE)
        if answer:
            found.append(obj)
    return found


def _flush(files: list) -> None:
    for file in files:
        try:
            if not file.closed and file.writable():
                file.flush()
        except Exception:
            pass


def _finalize_mpi() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        from ipydist.rank.healing import spares
        from ipydist.torch._core import topology

        rt = topology.get()
        if rt is not None:
            spares.dismiss(rt.rank)  # they finalize with the ranks
        mpi.Finalize()
