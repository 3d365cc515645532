"""``ipydist install-kernel`` / ``uninstall-kernel`` (issue 6, item 1): the kernelspec shows in
``jupyter kernelspec list``, and a real kernel started from it through jupyter_client has
ipydist loaded, runs ``%dist_start`` and ``%%everyrank`` cells, and with ``--np`` starts its
ranks on first use. Specs go into a temporary prefix that ``JUPYTER_PATH`` points at.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import as_merged, cluster_processes, wait_gone
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from test_orphans import run

from ipydist import cli


@pytest.fixture
def prefix(tmp_path, monkeypatch):
    """A prefix to install into, visible to Jupyter (and to the kernels it starts)."""
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    return tmp_path


def kernelspec_list() -> dict:
    out = subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["kernelspecs"]


def install(prefix, *args: str) -> None:
    assert cli.main(["install-kernel", "--prefix", str(prefix), *args]) == 0


def start_kernel(name: str):
    km = KernelManager(kernel_name=name, kernel_spec_manager=KernelSpecManager())
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def stop_kernel(km, kc) -> None:
    kc.stop_channels()
    km.shutdown_kernel(now=False)


def test_install_lists_the_kernel_and_uninstall_removes_it(prefix, capsys):
    install(prefix)
    assert "Installed kernelspec ipydist in" in capsys.readouterr().out
    specs = kernelspec_list()
    assert specs["ipydist"]["spec"]["display_name"] == "Python 3 (ipydist)"
    assert specs["ipydist"]["spec"]["argv"][-1] == "--ext=ipydist"
    assert specs["ipydist"]["resource_dir"].startswith(str(prefix))
    assert cli.main(["uninstall-kernel"]) == 0
    assert "ipydist" not in kernelspec_list()


def test_name_display_name_and_np_are_written(prefix):
    install(prefix, "--name", "dist-4", "--display-name", "Four ranks", "--np", "4")
    spec = kernelspec_list()["dist-4"]["spec"]
    assert spec["display_name"] == "Four ranks"
    assert spec["env"] == {"IPYDIST_KERNEL_NP": "4"}
    assert cli.main(["uninstall-kernel", "--name", "dist-4"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["install-kernel", "--name", "bad name!"], "--name bad name!: a kernel name may use only"),
    (["install-kernel", "--np", "0"], "--np 0: the number of ranks must be a whole number of at "
     "least 1"),
    (["uninstall-kernel", "--name", "nothing-here"], "no kernel named 'nothing-here' is "
     "installed"),
    (["uninstall-kernel", "--name", "python3"], "the kernel 'python3' was not installed by "
     "ipydist; remove it with jupyter kernelspec remove python3"),
])
def test_bad_input_is_refused_with_a_clear_message(prefix, capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv if "--prefix" in argv or argv[0] != "install-kernel"
                 else [*argv, "--prefix", str(prefix)])
    assert exit.value.code in (1, 2)
    assert message in capsys.readouterr().err


def test_the_kernel_runs_dist_start_and_everyrank_cells(prefix):
    install(prefix)
    before = set(cluster_processes())
    km, kc = start_kernel("ipydist")
    try:
        run(kc, "%dist_start --np 2")  # no %load_ext: the kernel loaded ipydist
        text = run(kc, "%%everyrank\nimport ipydist.torch as hvd, torch\n"
                       "print(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
        assert "[all ranks] 2.0" in as_merged(text, 2), text
    finally:
        stop_kernel(km, kc)
    left = set(cluster_processes()) - before
    assert wait_gone(left) == [], f"left running after the kernel shut down: {left}"


def test_a_kernel_installed_with_np_starts_its_ranks_on_first_use(prefix):
    install(prefix, "--np", "2")
    before = set(cluster_processes())
    km, kc = start_kernel("ipydist")
    try:
        assert set(cluster_processes()) == before, "no ranks before a cell needs them"
        text = run(kc, "%%everyrank\nimport ipydist.torch as hvd\nprint(hvd.size())")
        assert "Starting 2 ranks: this kernel starts them on first use" in text, text
        assert "[all ranks] 2" in as_merged(text, 2), text
        text = run(kc, "print(get_ipython().magics_manager.registry['DistMagics'].session.np)")
        assert text.strip() == "2", text
    finally:
        stop_kernel(km, kc)
    left = set(cluster_processes()) - before
    assert wait_gone(left) == [], f"left running after the kernel shut down: {left}"
