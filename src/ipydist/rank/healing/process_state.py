"""What a cell can change in a rank's process, beyond its variables, that later cells rely on:
it travels with a heal and with ``%dist_scale``'s new ranks, before the variables, so that a
replacement is the rank it replaces and rank 0's variables load there.

The list (docs/failures.md says why each entry is on it):

- what cells changed of ``sys.path`` (the entries added and removed: a replacement on another
  host keeps its own installation's), and the working directory: where a cell's ``import``
  looks;
- environment variables a cell set, changed or removed (those mpiexec, torchrun's names and
  ipydist set per rank are the replacement's own);
- the user's own modules (imported from outside the Python installation), by import in the
  order rank 0 imported them where the replacement reaches their file, else by value, as
  cloudpickle registers a module (:func:`by_value`);
- IPython's state a user sets: extensions loaded with ``%load_ext``, ``%autoreload``'s mode
  and ``%aimport`` lists, ``%matplotlib``;
- torch's process-wide settings a cell changed since the rank started: threads, the default
  dtype, deterministic algorithms, anomaly detection, float32 matmul precision (which sets
  TF32's use), grad mode, cuDNN's benchmark and deterministic flags.

What a rank sets for itself at its start (its device, its threads where no cell changed them)
is compared with rank 0's own start, so only what a cell changed travels.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import site
import sys
from dataclasses import dataclass, field

#: Environment variables each rank has its own of: torchrun's and ipydist's per-rank names,
#: and the launchers' (by prefix).
OWN_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                           "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "CUDA_VISIBLE_DEVICES", "PWD", "OLDPWD"})
OWN_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "OPAL_", "HYDRA_", "MPIR_", "MPICH_",
                "SLURM_", "IPYDIST_", "JPY_")
#: The autoreload extension's settings a user sets with ``%autoreload`` and ``%aimport``.
_AUTORELOAD_FLAGS = ("enabled", "check_all", "autoload_obj", "hide_errors")


@dataclass
class ProcessState:
    """Rank 0's process, as far as it travels (see the module's docstring)."""

    #: ``sys.path``'s entries a cell added before the ones the rank started with, those it
    #: added after them, and those it removed (the rest may differ between hosts).
    path_front: list[str]
    path_back: list[str]
    path_removed: list[str]
    cwd: str
    env_set: dict[str, str]
    env_unset: list[str]
    #: The user's modules, (name, file), in the order they were imported.
    modules: list[tuple[str, str]]
    extensions: list[str]
    autoreload: dict | None
    #: matplotlib's backend, and whether ``%matplotlib`` set it up in the shell.
    matplotlib: tuple[str, bool] | None
    torch: dict = field(default_factory=dict)


#: This rank's environment and torch's settings when it registered (:func:`remember_start`).
_start: dict = {}


def remember_start() -> None:
    """What this rank's process was when it registered, before any cell: later, what differs
    from it is what cells changed."""
    _start["env"] = dict(os.environ)
    _start["path"] = list(sys.path)
    _start["torch"] = torch_settings()


def _own(name: str) -> bool:
    return name in OWN_VARIABLES or name.startswith(OWN_PREFIXES)


def gather(shell) -> ProcessState:
    """On rank 0: what travels of its process."""
    env_start = _start.get("env", {})
    env_set = {k: v for k, v in os.environ.items() if env_start.get(k) != v and not _own(k)}
    env_unset = [k for k in env_start if k not in os.environ and not _own(k)]
    torch_start = _start.get("torch", {})
    changed = {k: v for k, v in torch_settings().items() if torch_start.get(k) != v}
    front, back, removed = path_changes(_start.get("path", sys.path), sys.path)
    return ProcessState(
        path_front=front, path_back=back, path_removed=removed, cwd=os.getcwd(),
        env_set=env_set, env_unset=env_unset,
        modules=user_modules(), extensions=sorted(shell.extension_manager.loaded),
        autoreload=_autoreload(shell), matplotlib=_matplotlib(shell), torch=changed)


def apply(state: ProcessState, shell) -> dict[str, str]:
    """On a replacement: take rank 0's process state. Returns the user's modules it could not
    import, each with why (rank 0 then sends them by value)."""
    try:
        os.chdir(state.cwd)
    except OSError:
        pass  # not on this host: the directory rank 0's cells work in is named in the docs
    sys.path[:] = changed_path(sys.path, state.path_front, state.path_back,
                               state.path_removed)
    for name in state.env_unset:
        os.environ.pop(name, None)
    os.environ.update(state.env_set)
    importlib.invalidate_caches()
    failed = {}
    for name, path in state.modules:
        if name in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        if os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
            del sys.modules[name]  # another file of that name: rank 0's travels instead
            failed[name] = f"{name} here is {module.__file__}, not {path}"
    for name in state.extensions:
        if name not in shell.extension_manager.loaded:
            with contextlib.suppress(Exception):
                shell.extension_manager.load_extension(name)
    _set_autoreload(shell, state.autoreload)
    _set_matplotlib(shell, state.matplotlib)
    set_torch_settings(state.torch)
    return failed


def path_changes(start: list[str], now: list[str]) -> tuple[list, list, list]:
    """What cells did to ``sys.path`` since ``start``: (the entries added before the first
    entry of ``start`` still there, the others added, the entries removed)."""
    kept = set(start) & set(now)
    first = next((i for i, entry in enumerate(now) if entry in kept), len(now))
    front = [entry for entry in now[:first] if entry not in kept]
    back = [entry for entry in now[first:] if entry not in kept]
    return front, back, [entry for entry in start if entry not in set(now)]


def changed_path(path: list[str], front: list[str], back: list[str],
                 removed: list[str]) -> list[str]:
    """``path`` (a new rank's own, which may differ from rank 0's on another host) with rank
    0's cells' changes (:func:`path_changes`) made to it."""
    gone = set(removed) | set(front) | set(back)
    return [*front, *(entry for entry in path if entry not in gone), *back]


@contextlib.contextmanager
def by_value(names):
    """While rank 0 pickles its variables: the modules ``names`` travel by value (their
    functions and classes with them), for a replacement that cannot import them."""
    import cloudpickle

    registered = []
    try:
        for name in names:
            module = sys.modules.get(name)
            if module is not None:
                with contextlib.suppress(Exception):
                    cloudpickle.register_pickle_by_value(module)
                    registered.append(module)
        yield
    finally:
        for module in registered:
            with contextlib.suppress(Exception):
                cloudpickle.unregister_pickle_by_value(module)


def _library_folders() -> tuple[str, ...]:
    """Where Python's own modules and installed packages are (and ipydist's), as prefixes."""
    ipydist = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, ipydist}
    with contextlib.suppress(Exception):
        folders.update(site.getsitepackages())
        folders.add(site.getusersitepackages())
    return tuple({os.path.join(form(f), "") for f in folders if f
                  for form in (os.path.abspath, os.path.realpath)})


def user_modules() -> list[tuple[str, str]]:
    """The modules imported from outside Python's installation (the user's own), with their
    files, in the order they were imported; only those found again by their name (not the
    modules torch.compile writes for itself)."""
    libraries = _library_folders()
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name.startswith("__") or not path.endswith(".py"):
            continue
        if path.startswith(libraries):  # most of them, without a look at the disk
            continue
        real = os.path.realpath(path)
        if real.startswith(libraries):
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None or spec.name != name or not spec.origin:
            continue
        found.append((name, real))
    return found


def _autoreload(shell) -> dict | None:
    magics = shell.magics_manager.registry.get("AutoreloadMagics")
    if magics is None:
        return None
    reloader = magics._reloader
    out = {flag: getattr(reloader, flag, None) for flag in _AUTORELOAD_FLAGS}
    out["modules"] = sorted(reloader.modules)
    out["skip_modules"] = sorted(reloader.skip_modules)
    deduper = getattr(reloader, "deduper_reloader", None)
    out["deduper"] = getattr(deduper, "enabled", None)
    return out


def _set_autoreload(shell, settings: dict | None) -> None:
    magics = shell.magics_manager.registry.get("AutoreloadMagics")
    if settings is None or magics is None:
        return
    reloader = magics._reloader
    for flag in _AUTORELOAD_FLAGS:
        if settings.get(flag) is not None:
            setattr(reloader, flag, settings[flag])
    reloader.modules = dict.fromkeys(settings["modules"], True)
    reloader.skip_modules = dict.fromkeys(settings["skip_modules"], True)
    deduper = getattr(reloader, "deduper_reloader", None)
    if deduper is not None and settings.get("deduper") is not None:
        deduper.enabled = settings["deduper"]


def _matplotlib(shell) -> tuple[str, bool] | None:
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is None:
        return None
    runner = getattr(shell.magics_manager.registry.get("ExecutionMagics"), "default_runner",
                     None)
    return matplotlib.get_backend(), getattr(runner, "__name__", "") == "mpl_execfile"


def _set_matplotlib(shell, backend: tuple[str, bool] | None) -> None:
    if backend is None:
        return
    name, in_shell = backend
    with contextlib.suppress(Exception):
        if in_shell:  # %matplotlib: the shell's support, as the magic sets it up
            shell.enable_matplotlib("inline" if name.endswith("backend_inline") else name)
        else:
            import matplotlib

            matplotlib.use(name)


def torch_settings() -> dict:
    """torch's process-wide settings a cell can change (read without touching CUDA); one that
    cannot be read (torch refuses to say the matmul precision once its legacy and new APIs
    were both used) is left out. TF32's own flags are not read: torch derives them from the
    matmul precision, and setting both kinds is what it refuses."""
    import torch

    readers = {
        "threads": torch.get_num_threads,
        "dtype": torch.get_default_dtype,
        "deterministic": lambda: (torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()),
        "anomaly": lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "matmul_precision": torch.get_float32_matmul_precision,
        "grad": torch.is_grad_enabled,
        "cudnn": lambda: (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
    }
    settings = {}
    for name, read in readers.items():
        with contextlib.suppress(Exception):
            settings[name] = read()
    return settings


def set_torch_settings(settings: dict) -> None:
    """Set those of :func:`torch_settings` given (the ones a cell changed on rank 0)."""
    import torch

    setters = {
        "threads": torch.set_num_threads,
        "dtype": torch.set_default_dtype,
        "deterministic": lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        "anomaly": lambda v: torch.autograd.set_detect_anomaly(v[0], check_nan=v[1]),
        "matmul_precision": torch.set_float32_matmul_precision,
        "grad": torch.set_grad_enabled,
        "cudnn": _set_cudnn,
    }
    for name, value in settings.items():
        with contextlib.suppress(Exception):
            setters[name](value)


def _set_cudnn(value) -> None:
    import torch

    cudnn = torch.backends.cudnn
    cudnn.benchmark, cudnn.deterministic = value
