"""``%dist_mode everyrank | local`` and ``ipydist doctor`` (issue 6, items 2 and 3)."""

from __future__ import annotations

import os
import stat

import pytest
from helpers import NP, as_merged, run_cell
from IPython.core.error import UsageError

from ipydist import cli


@pytest.fixture
def local_mode_after(shell, magics):
    yield
    magics._set_mode("local")


def test_everyrank_mode_sends_every_cell_to_the_ranks_and_says_so(shell, capsys, cluster,
                                                                  magics, local_mode_after):
    _, out, _ = run_cell(shell, capsys, "%dist_mode everyrank")
    assert f"Every cell now runs on ranks 0-{NP - 1}, until %dist_mode local." in out
    result, out, err = run_cell(shell, capsys, "import os\nwhere = os.getpid()\nprint('hello')")
    assert result.error_in_exec is None, err
    assert out.startswith(f"[%dist_mode everyrank: ranks 0-{NP - 1}]\n"), out
    assert "[all ranks] hello" in as_merged(out), out
    assert "where" not in shell.user_ns, "the cell ran on the ranks, not in the notebook"
    pids = cluster.pull("where")
    assert sorted(pids) == sorted(r["pid"] for r in cluster.ranks)
    # ipydist's own magics still run in the notebook
    _, out, _ = run_cell(shell, capsys, "%dist_push NP")
    assert "[%dist_mode" not in out
    _, out, _ = run_cell(shell, capsys, "%%everyrank --ranks 0\nprint('only rank 0')")
    assert "[rank 0] only rank 0" in out and "[%dist_mode" not in out, out
    _, out, _ = run_cell(shell, capsys, "%dist_mode local")
    assert "Cells run in the notebook again." in out
    _, out, _ = run_cell(shell, capsys, "where = 'here'\nprint(where)")
    assert out == "here\n", out


def test_stopping_the_cluster_returns_to_local_mode(shell, capsys, cluster, local_mode_after):
    run_cell(shell, capsys, "%dist_mode everyrank")
    _, out, _ = run_cell(shell, capsys, "%dist_stop")
    assert "Cells run in the notebook again (%dist_mode local)." in out, out
    _, out, _ = run_cell(shell, capsys, "print('in the notebook')")
    assert out == "in the notebook\n", out


def test_bad_mode_and_mode_without_a_cluster(shell, capsys, no_cluster, local_mode_after):
    result, _, _ = run_cell(shell, capsys, "%dist_mode everywhere")
    assert isinstance(result.error_in_exec, UsageError)
    assert "argument mode: invalid choice: 'everywhere'" in str(result.error_in_exec)
    result, _, _ = run_cell(shell, capsys, "%dist_mode everyrank")
    assert "no cluster is running: start one with %dist_start --np N." in str(
        result.error_in_exec)
    _, out, _ = run_cell(shell, capsys, "print(1 + 1)")
    assert out == "2\n", "a failed %dist_mode everyrank leaves cells running here"


# --- doctor ------------------------------------------------------------------------------------


def lines_by_check(text: str) -> dict[str, str]:
    return {line.split()[1]: line for line in text.splitlines() if line.strip()}


def test_doctor_passes_here_and_runs_an_allreduce(capsys):
    assert cli.main(["doctor"]) == 0
    checks = lines_by_check(capsys.readouterr().out)
    for name in ("Python", "torch", "mpiexec", "mpi4py", "ipyparallel", "ipywidgets",
                 "anywidget", "JupyterLab", "cluster"):
        assert checks[name].startswith("OK "), checks[name]
    assert checks["GPUs"].split()[0] in ("OK", "NOTE"), checks["GPUs"]
    assert checks["kernelspec"].split()[0] in ("OK", "NOTE"), checks["kernelspec"]
    assert "2 ranks started, allreduce correct" in checks["cluster"]
    assert checks["JupyterLab"].endswith("ipydist's panel"), "make test builds the panel"


def test_doctor_notes_an_install_without_the_side_panel(tmp_path, monkeypatch):
    import jupyter_core.paths

    from ipydist.cli import doctor

    widgets = tmp_path / "@jupyter-widgets" / "jupyterlab-manager"
    widgets.mkdir(parents=True)
    (widgets / "package.json").write_text("{}")
    monkeypatch.setattr(jupyter_core.paths, "jupyter_path", lambda *_: [str(tmp_path)])
    check = doctor.check_lab_extension()
    assert check.status == doctor.NOTE and "make lab" in check.detail, check


def test_doctor_reports_a_missing_mpiexec_with_its_fix_and_exits_1(capsys, monkeypatch):
    monkeypatch.setenv("IPYDIST_MPIEXEC", "no-such-mpiexec")
    with pytest.raises(SystemExit) as exit:
        cli.main(["doctor"])
    assert exit.value.code == 1
    out = capsys.readouterr()
    checks = lines_by_check(out.out)
    assert checks["mpiexec"].startswith(
        "FAIL  mpiexec            $IPYDIST_MPIEXEC = no-such-mpiexec: no such executable "
        "Fix: Pass the path of an mpiexec"), checks["mpiexec"]
    assert checks["cluster"].startswith("--") and "not started" in checks["cluster"]
    assert "some checks failed" in out.err


def test_doctor_catches_an_mpiexec_of_another_mpi_than_mpi4py_loads(capsys, monkeypatch,
                                                                     tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.2.0 (MPICH)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("IPYDIST_MPIEXEC", os.fspath(fake))
    with pytest.raises(SystemExit):
        cli.main(["doctor"])
    checks = lines_by_check(capsys.readouterr().out)
    assert checks["mpiexec"].startswith("OK    mpiexec            MPICH: "), checks["mpiexec"]
    assert checks["mpi4py"].startswith("FAIL") and "but mpiexec is MPICH" in checks["mpi4py"]
