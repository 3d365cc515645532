"""The "Python 3 (ipydist)" Jupyter kernel: an ordinary IPython kernel with ipydist loaded.

Installing it is what ``python -m ipykernel install`` does -- ipykernel writes the spec (its
argv, its logos) and jupyter_client's ``KernelSpecManager`` puts it where ``--user``,
``--sys-prefix`` or ``--prefix`` say -- plus two things: the kernel starts with
``--ext=ipydist``, and with ``--np N`` it carries ``IPYDIST_KERNEL_NP=N`` in its environment,
which makes the first cell that needs ranks start N of them (see :mod:`ipydist.magics`).
Nothing else differs, so the kernel behaves like the python3 one in every other respect.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ipydist import protocol
from ipydist.error_base import IpydistError

DEFAULT_NAME = "ipydist"
DEFAULT_DISPLAY_NAME = "Python 3 (ipydist)"
#: The argument that loads the extension; also how an ipydist kernelspec is recognised.
EXTENSION_ARG = "--ext=ipydist"


class KernelSpecError(IpydistError):
    """Bad arguments or a spec that cannot be installed or removed; the message says why."""


def install(name: str = DEFAULT_NAME, display_name: str | None = None, np: int | None = None,
            user: bool = False, prefix: str | None = None) -> str:
    """Install the kernelspec; return the folder it was written to.

    ``user``: into the user's Jupyter data folder; ``prefix``: under ``PREFIX/share/jupyter``
    (``sys.prefix`` for ``--sys-prefix``); neither: system-wide, as ipykernel does.
    """
    from ipykernel.kernelspec import get_kernel_dict, write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager, _is_valid_kernel_name

    if not _is_valid_kernel_name(name):
        raise KernelSpecError(
            f"--name {name}: a kernel name may use only letters, digits, '.', '_' and '-'.")
    metadata = {**get_kernel_dict().get("metadata", {}), "ipydist": {"np": np}}
    overrides: dict = {"display_name": display_name or DEFAULT_DISPLAY_NAME, "metadata": metadata}
    if np is not None:
        overrides["env"] = {protocol.KERNEL_NP_ENV: str(np)}
    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = write_kernel_spec(
            Path(tmp) / name, overrides=overrides, extra_arguments=[EXTENSION_ARG])
        try:
            return KernelSpecManager().install_kernel_spec(
                spec_dir, kernel_name=name, user=user, prefix=prefix)
        except PermissionError as e:
            raise KernelSpecError(
                f"no permission to write {e.filename}: install for yourself with --user, or "
                "into this environment with --sys-prefix.") from None


def uninstall(name: str = DEFAULT_NAME) -> str:
    """Remove an ipydist kernelspec; return the folder removed. Refuses any other kernel."""
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    found = manager.find_kernel_specs()
    if name not in found:
        ours = sorted(n for n, d in found.items() if is_ipydist_spec(d))
        hint = f" ipydist kernels installed: {', '.join(ours)}." if ours else ""
        raise KernelSpecError(f"no kernel named {name!r} is installed.{hint}")
    if not is_ipydist_spec(found[name]):
        raise KernelSpecError(
            f"the kernel {name!r} was not installed by ipydist; remove it with "
            f"jupyter kernelspec remove {name}.")
    try:
        return manager.remove_kernel_spec(name)
    except PermissionError as e:
        raise KernelSpecError(f"no permission to remove {e.filename}.") from None


def installed() -> dict[str, str]:
    """Name -> folder of every ipydist kernelspec Jupyter can see."""
    from jupyter_client.kernelspec import KernelSpecManager

    return {n: d for n, d in KernelSpecManager().find_kernel_specs().items()
            if is_ipydist_spec(d)}


def is_ipydist_spec(folder: str) -> bool:
    try:
        spec = json.loads((Path(folder) / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return EXTENSION_ARG in spec.get("argv", [])
