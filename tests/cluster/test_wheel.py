"""The wheel a user installs carries JupyterLab's side panel prebuilt: built from this checkout
(as ``make wheel`` builds it, after ``make lab``'s build of the labextension, which ``make test``
does), installed into a new virtual environment, it puts ipydist's labextension where
JupyterLab finds it, and ``jupyter labextension list`` there shows it enabled, with no build.

The new environment takes its other packages from the test venv (a ``.pth`` file), so that the
test downloads nothing; ipydist itself comes from the wheel, which is first on its path.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


#: What a build needs of the checkout is everything but these (the build writes build/ and
#: an egg-info beside the sources: a copy keeps them out of the checkout).
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "site",
                                    "test-artifacts", "*.egg-info", "__pycache__", ".*_cache",
                                    "notebooks", "flake-runs", ".gpu-kit")


def test_the_wheel_installs_the_side_panel_that_jupyterlab_lists(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("ipydist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    panel = [n for n in names if "/share/jupyter/labextensions/ipydist/" in n]
    assert any(n.endswith("/ipydist/package.json") for n in panel), names[-20:]
    assert any("/static/remoteEntry." in n for n in panel), "the panel comes prebuilt"

    env_dir = tmp_path / "newcomer"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    own = env_dir / "lib" / version / "site-packages"
    (own / "test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]

    where = subprocess.run([str(python), "-c", "import ipydist, json; print(json.dumps("
                            "ipydist.__file__))"], capture_output=True, text=True, check=True)
    assert json.loads(where.stdout).startswith(str(own)), "ipydist from the wheel, not the repo"
    assert (env_dir / "share" / "jupyter" / "labextensions" / "ipydist" / "package.json").is_file()
    # (the test venv's script, run by the new environment's Python, as its own would be)
    script = Path(sys.executable).parent / "jupyter-labextension"
    listed = subprocess.run([str(python), str(script), "list"],
                            capture_output=True, text=True, timeout=120)
    text = listed.stdout + listed.stderr
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("ipydist ")), "")
    assert "enabled" in line and "OK" in line, text
    assert str(env_dir / "share" / "jupyter" / "labextensions") in text, text
