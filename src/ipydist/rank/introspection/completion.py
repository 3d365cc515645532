"""Tab completion and help for the notebook, computed on this rank (see
:mod:`ipydist.notebook.completion`), asked on the control channel so that a rank answers
while its cell runs too.

The answer is the rank kernel's own (``do_complete``: jedi through IPython's completer;
``do_inspect``: IPython's inspector), computed in a worker thread of its own: the control
channel's thread, which also carries stacks and pdb commands, waits for it at most
:data:`ANSWER_SECONDS` (:data:`FIRST_ANSWER_SECONDS` for this rank's first answer, while jedi
loads), and for a question asked while another is still being worked on, as long for that
one to end. Only one worker runs at a time, since IPython's completer keeps the text it
completes in its own attributes.

Jedi's first completion loads its grammar and the builtins' stubs: 0.5-0.9 s on a quiet core,
where the next ones take 0.01-0.1 s, and JupyterLab drops a kernel's completion that takes
more than 1 s (its ``providerTimeout``). So the notebook asks rank 0 to :func:`warm` up in
the background once its cluster is there, and the first Tab is as quick as the others.

Completion reads the live namespace while the main thread may change it, and must not run
the user's code: jedi here never evaluates a property or ``__getitem__`` (which, on a model,
could start a collective and hang this rank), and IPython's own evaluation stays "limited"
(no calls but safe ones).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import threading
import time

#: How long the control thread waits for an answer before it says so.
ANSWER_SECONDS = 1.5
#: The same, until this rank has answered once (or warmed up): jedi's first completion loads
#: its grammar and caches (past 1.5 s on a loaded 2-core machine, where the first Tab after a
#: start came back empty: issue 46). A one-process kernel's first Tab waits as long.
FIRST_ANSWER_SECONDS = 6.0

_lock = threading.Lock()  # held by the one worker computing an answer
_answered = threading.Event()  # set once jedi has loaded (an answer, or the warm-up)


def answer(request: dict) -> dict:
    """``{"reply": <the kernel's reply>}`` to ``{"what": "complete" | "inspect", "code",
    "cursor_pos", ...}``, or ``{"busy": True}`` when no answer came in time."""
    limit = ANSWER_SECONDS if _answered.is_set() else FIRST_ANSWER_SECONDS
    deadline = time.monotonic() + limit
    if not _lock.acquire(timeout=limit):  # another question (or the warm-up) is worked on
        return {"busy": True}
    done = threading.Event()
    found: dict = {}

    def work():
        try:
            found["reply"] = _reply(request)
            _answered.set()
        except Exception as e:  # the notebook says no rank answered
            found["error"] = f"{type(e).__name__}: {e}"
        finally:
            _lock.release()
            done.set()

    threading.Thread(target=work, name="ipydist-completion", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        return {"busy": True}  # the worker finishes in its own time, holding the lock
    if "error" in found:
        raise RuntimeError(found["error"])
    return {"reply": found["reply"]}


def warm() -> dict:
    """Load jedi now, in a worker thread, so that the first Tab finds it loaded (see the module
    docstring); answers at once. Nothing when jedi is loaded or a question is being worked on."""
    if _answered.is_set() or not _lock.acquire(blocking=False):
        return {"warming": False}

    def work():
        try:  # a bare name (the builtins' stubs) and an attribute (the inference)
            for code in ("pri", "str.jo"):
                _reply({"what": "complete", "code": code, "cursor_pos": len(code)})
            _answered.set()
        except Exception:  # the first question will load it then
            pass
        finally:
            _lock.release()

    threading.Thread(target=work, name="ipydist-completion-warm", daemon=True).start()
    return {"warming": True}


def _reply(request: dict) -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    _make_safe(shell)
    code, cursor_pos = str(request["code"]), int(request["cursor_pos"])
    if request["what"] == "complete":
        return shell.kernel.do_complete(code, cursor_pos)
    return shell.kernel.do_inspect(code, cursor_pos, int(request.get("detail_level", 0)),
                                   set(request.get("omit_sections") or ()))


def save_parso_cache_atomically() -> None:
    """Make parso (jedi's parser) write each file of its cache whole or not at all.

    parso keeps the modules it parsed in a cache every Python of the user shares
    (``~/.cache/jedi``), and writes each file in place. A rank warms jedi up right after its
    start (:func:`warm`), so a stop or a kill soon after a start can end it mid-write: it once
    left an empty file, which parso's load does not survive, and from then on every kernel on
    the machine, the notebook's own too, completed nothing. Here a file is written beside its
    place and renamed into it."""
    try:
        from parso import cache
    except ImportError:
        return
    if getattr(getattr(cache, "_save_to_file_system", None), "atomic", False):
        return

    def save_whole(hashed_grammar, path, item, cache_path=None):
        target = cache._get_hashed_path(hashed_grammar, path, cache_path=cache_path)
        fd, written = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(item, f, pickle.HIGHEST_PROTOCOL)
            os.replace(written, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(written)
            raise

    save_whole.atomic = True  # type: ignore[attr-defined]  # a mark, read by getattr above
    cache._save_to_file_system = save_whole


def _make_safe(shell) -> None:
    """No user code runs for a completion (see the module docstring), and parso's cache is
    written safely (:func:`save_parso_cache_atomically`)."""
    save_parso_cache_atomically()
    try:
        import jedi

        jedi.settings.allow_unsafe_interpreter_executions = False
    except ImportError:
        pass
    completer = getattr(shell, "Completer", None)
    if completer is not None and getattr(completer, "evaluation", "limited") not in (
            "forbidden", "minimal", "limited"):
        completer.evaluation = "limited"
