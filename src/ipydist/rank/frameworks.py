"""What a training framework imported on a rank needs to know of ipydist's ranks, told by
ipydist rather than by the user's code.

Lightning (``lightning.pytorch`` and the older ``pytorch_lightning``) counts the processes of
a host from its devices (``devices="auto"``: one CPU, or the one GPU each rank sees), and
starts processes of its own for the ``*_spawn``, ``*_fork`` and ``*_notebook`` strategies. On a
rank the processes exist already: ``devices="auto"`` means the ranks on this host, and a
strategy that would start more is refused with a message that says what to use instead.

Nothing here imports a framework: a finder on ``sys.meta_path`` waits until the user's code
imports one, lets the import finish, then adjusts that framework's registries (the names
``Trainer(accelerator=..., strategy=...)`` looks up), so a cell that never imports Lightning
pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
import warnings

#: Lightning's packages: each has its own registries.
LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
#: Start methods with which a Lightning strategy starts processes itself.
SPAWNING = ("spawn", "fork", "forkserver")


def install(local_size: int) -> None:
    """Adjust Lightning when it is imported (at once if it already is); ``local_size``: the
    ranks on this host."""
    for name in LIGHTNING_PACKAGES:
        if name in sys.modules:
            adjust_lightning(sys.modules[name], local_size)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(local_size))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a Lightning package, it finds the real module and has its
    loader call :func:`adjust_lightning` once the module has run."""

    def __init__(self, local_size: int):
        self.local_size = local_size

    def find_spec(self, name, path, target=None):
        if name not in LIGHTNING_PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _AdjustingLoader(spec.loader, self.local_size)
        return spec


class _AdjustingLoader(importlib.abc.Loader):
    def __init__(self, loader, local_size: int):
        self.loader, self.local_size = loader, local_size

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        adjust_lightning(module, self.local_size)


#: Lightning's hint, on a host where Slurm's ``srun`` exists, to start the script with it: the
#: ranks were started by mpiexec (or by srun, when the hint does not appear), as chosen.
SRUN_HINT = "The `srun` command is available on your system but is not used"


def adjust_lightning(package, local_size: int) -> None:
    """Make ``devices="auto"`` the ranks on this host on the CPU, refuse the strategies that
    start processes, in the registries of one Lightning package, and drop a hint that does
    not apply to ranks."""
    warnings.filterwarnings("ignore", message=re.escape(SRUN_HINT))
    strategies = sys.modules[f"{package.__name__}.strategies"].StrategyRegistry
    for name, entry in strategies.items():
        if entry.get("init_params", {}).get("start_method") in SPAWNING:
            entry["strategy"] = _refusal(name, local_size)
    accelerators = sys.modules[f"{package.__name__}.accelerators"].AcceleratorRegistry
    cpu = accelerators.get("cpu").__class__
    if not getattr(cpu, "ipydist_ranks", None):
        accelerators.register("cpu", _ranks_as_devices(cpu, local_size), override=True,
                              description="CPU: devices='auto' is the ipydist ranks on this host")


def _ranks_as_devices(cpu: type, local_size: int) -> type:
    """Lightning's CPU accelerator, whose ``devices="auto"`` counts this host's ranks."""

    class RanksOnThisHost(cpu):
        ipydist_ranks = local_size

        @staticmethod
        def auto_device_count() -> int:
            return local_size

    RanksOnThisHost.__name__ = RanksOnThisHost.__qualname__ = cpu.__name__
    return RanksOnThisHost


def _refusal(name: str, local_size: int):
    def refuse(**_):
        raise ValueError(
            f"Trainer(strategy={name!r}) starts processes of its own, and on ipydist's ranks "
            f"they exist already (one per rank, {local_size} on this host). Use "
            f"strategy={name.replace('_spawn', '').replace('_fork', '').replace('_notebook', '')!r}"
            f" with devices={local_size} (or devices='auto'), in an %%everyrank cell.")

    return refuse
