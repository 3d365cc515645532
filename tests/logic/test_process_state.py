"""What travels of a rank's process with a heal (``rank/healing/process_state.py``): only what a
cell changed since the rank started, the user's own modules (not Python's, not installed
packages), each imported again where it can be, else sent by value. In this process, with its
``sys.path``, working directory and environment put back after each test;
``tests/cluster/test_heal_fidelity.py`` takes it to real replacements."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest
import torch

from ipydist.rank.healing import process_state


@pytest.fixture
def kept_process(monkeypatch):
    """This process's sys.path, working directory, environment and torch threads, put back."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(os.getcwd())
    for name in ("MY_TEST_CELL_SETTING", "MY_TEST_GONE", "RANK", "IPYDIST_TEST_OWN"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for name in [n for n in sys.modules if n.startswith("ipydist_test_user")]:
        del sys.modules[name]


def test_only_what_a_cell_changed_travels(kept_process, monkeypatch, shell):
    monkeypatch.setenv("MY_TEST_GONE", "there at start")
    process_state.remember_start()
    os.environ["MY_TEST_CELL_SETTING"] = "on"
    del os.environ["MY_TEST_GONE"]
    os.environ["RANK"] = "7"  # each rank's own: never travels
    os.environ["IPYDIST_TEST_OWN"] = "ipydist's, set per rank"
    torch.set_num_threads(max(1, torch.get_num_threads() - 1) if torch.get_num_threads() > 1
                          else 2)
    state = process_state.gather(shell)
    assert state.env_set == {"MY_TEST_CELL_SETTING": "on"}
    assert state.env_unset == ["MY_TEST_GONE"]
    assert list(state.torch) == ["threads"]
    assert state.cwd == os.getcwd()


def test_sys_path_travels_as_the_changes_cells_made():
    """A new rank on another host may have its own installation's entries: it keeps them,
    with what rank 0's cells put before, after, and took away."""
    start = ["", "/a/lib/python3.11", "/a/site-packages"]
    now = ["/my/project", "", "/a/lib/python3.11", "/a/site-packages", "/extra"]
    changes = process_state.path_changes(start, now)
    assert changes == (["/my/project"], ["/extra"], [])
    elsewhere = ["", "/b/lib/python3.11", "/b/site-packages"]
    assert process_state.changed_path(elsewhere, *changes) == [
        "/my/project", "", "/b/lib/python3.11", "/b/site-packages", "/extra"]
    removed = process_state.path_changes(start, ["", "/a/site-packages"])
    assert removed == ([], [], ["/a/lib/python3.11"])
    assert process_state.changed_path(start, *removed) == ["", "/a/site-packages"]


def test_the_users_modules_are_found_imported_again_or_sent_by_value(kept_process, tmp_path,
                                                                   shell):
    (tmp_path / "ipydist_test_user_mod.py").write_text("def triple(x):\n    return 3 * x\n")
    sys.path.insert(0, str(tmp_path))
    import ipydist_test_user_mod  # noqa: F401  # a user's module, from a cell-added path

    found = {name: path for name, path in process_state.user_modules()
             if name.startswith("ipydist_test_user")}  # the tests' own modules are users' too
    assert found == {"ipydist_test_user_mod": str(tmp_path / "ipydist_test_user_mod.py")}
    state = process_state.gather(shell)
    del sys.modules["ipydist_test_user_mod"]
    assert process_state.apply(state, shell) == {}  # imported again, as on rank 0
    assert "ipydist_test_user_mod" in sys.modules
    del sys.modules["ipydist_test_user_mod"]
    (tmp_path / "ipydist_test_user_mod.py").unlink()
    failed = process_state.apply(state, shell)
    assert failed == {"ipydist_test_user_mod": "ModuleNotFoundError: No module named "
                                               "'ipydist_test_user_mod'"}


def test_a_module_sent_by_value_needs_no_file_where_it_loads(kept_process, tmp_path):
    (tmp_path / "ipydist_test_user_val.py").write_text("def triple(x):\n    return 3 * x\n")
    sys.path.insert(0, str(tmp_path))
    import ipydist_test_user_val

    with process_state.by_value(["ipydist_test_user_val"]):
        payload = cloudpickle.dumps(ipydist_test_user_val.triple)
    by_reference = cloudpickle.dumps(ipydist_test_user_val.triple)
    del sys.modules["ipydist_test_user_val"]
    sys.path.remove(str(tmp_path))
    assert cloudpickle.loads(payload)(2) == 6
    with pytest.raises(ModuleNotFoundError):
        cloudpickle.loads(by_reference)
