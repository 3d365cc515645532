"""The one pickle of rank 0's variables that a replacement loads (``rank/healing/state_pickle.py``):
what tensors share stays shared, each storage travels once, every tensor comes back equal, and
a variable that does not pickle or does not load is named with why, the others kept. Pure
logic on CPU tensors; ``tests/cluster/test_gpu_shared.py`` heals CUDA state on a GPU,
``tests/cluster/test_heal_fidelity.py`` a notebook's state on real ranks."""

from __future__ import annotations

import pytest
import torch

from ipydist.rank.healing.stand_ins import NotCopied, NotCopiedError
from ipydist.rank.healing.state_pickle import NotLoaded, load, pack


def _copied(variables: dict) -> dict:
    payload, skipped = pack(variables)
    assert skipped == {}
    return load(payload, None, [])


def test_views_of_one_storage_share_it_again_and_it_travels_once():
    base = torch.randn(10_000)
    copied = _copied({"base": base, "head": base[:100], "every_other": base[::2],
                      "as_matrix": base.view(100, 100)})
    for name in ("head", "every_other", "as_matrix"):
        assert copied[name].untyped_storage().data_ptr() == copied["base"].data_ptr(), name
    copied["base"][0] = 7.0
    assert copied["head"][0] == 7.0 and copied["as_matrix"][0, 0] == 7.0
    one_copy = len(pack({"base": base})[0])
    assert len(pack({"base": base, "head": base[:100]})[0]) < one_copy + 1000  # not twice


def test_a_model_and_its_optimizer_come_back_bit_for_bit_and_still_linked():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    odd = {"half": torch.randn(5).half(), "bf16": torch.ones(3, dtype=torch.bfloat16),
           "ints": torch.arange(6), "empty": torch.empty(0), "flag": torch.tensor(True)}
    copied = _copied({"model": model, "opt": opt, "odd": odd})
    assert copied["opt"].param_groups[0]["params"][0] is next(copied["model"].parameters())
    for (_, a), (_, b) in zip(model.state_dict().items(), copied["model"].state_dict().items()):
        assert torch.equal(a, b)
    state = copied["opt"].state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    for name, value in odd.items():
        assert copied["odd"][name].dtype == value.dtype and torch.equal(copied["odd"][name], value)
    # what came back is writable and a tensor of its own, not a read-only view of the pickle
    copied["odd"]["ints"] += 1
    assert copied["odd"]["ints"].tolist() == [1, 2, 3, 4, 5, 6]


def test_the_tensors_bytes_travel_beside_the_pickle_from_their_own_memory():
    """A heal sends the storages apart (over MPI, in chunks) from where they lie: the pickle
    is small, each storage is there once, and what comes back uses the memory it was
    received into, with no second copy."""
    import numpy as np

    base = torch.arange(1 << 16, dtype=torch.float32)
    storages: list = []
    payload, _ = pack({"base": base, "head": base[:10], "other": torch.ones(3)}, storages)
    assert len(payload) < 4000 and len(storages) == 2
    assert memoryview(storages[0]).nbytes == base.nbytes
    assert np.shares_memory(np.asarray(memoryview(storages[0])), base.numpy())  # no copy
    received = [np.array(memoryview(s), dtype=np.uint8) for s in storages]  # as MPI would
    copied = load(payload, received, [])
    assert torch.equal(copied["base"], base) and copied["head"].data_ptr() == copied[
        "base"].data_ptr()
    assert np.shares_memory(copied["base"].numpy(), received[0])


def test_on_one_host_the_bytes_go_through_one_shared_memory_file(tmp_path, monkeypatch):
    """What rank 0 writes into /dev/shm (here a folder of the test's) and a replacement maps:
    every storage back, empty ones too, writable once the file is gone (copy-on-write pages);
    ``IPYDIST_HEAL_SHARED_MEMORY=none`` keeps it all on MPI."""
    from ipydist.rank.healing import state_transfer

    monkeypatch.setenv(state_transfer.SHARED_MEMORY_VARIABLE, str(tmp_path))
    model = torch.nn.Linear(3, 2)
    storages: list = []
    payload, _ = pack({"model": model, "empty": torch.empty(0), "x": torch.arange(10.0)},
                      storages)
    views = [memoryview(s).cast("B") for s in storages]
    shared = state_transfer._write_shared(views, state_transfer._Progress(1), 1)
    assert shared is not None and shared[0].startswith(str(tmp_path))
    arrays = state_transfer._map_shared(shared, [v.nbytes for v in views])
    state_transfer._remove(shared[0])
    assert list(tmp_path.iterdir()) == []
    copied = load(payload, arrays, [])
    copied["x"][0] = 7.0  # writable, and only this copy changes
    assert copied["x"].tolist() == [7.0, *range(1, 10)]
    assert torch.equal(copied["model"].weight, model.weight)
    assert copied["empty"].shape == (0,)
    monkeypatch.setenv(state_transfer.SHARED_MEMORY_VARIABLE, "none")
    assert state_transfer._write_shared(views, state_transfer._Progress(1), 1) is None


class _LoadsNowhere:
    """Pickles, and refuses to load (as a class whose module a replacement lacks would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __setstate__(self, state):
        raise ValueError("not here")


def test_what_does_not_pickle_is_named_with_why_and_the_rest_travel():
    payload, skipped = pack({"gen": (i for i in range(3)), "kept": [1, 2]})
    assert list(skipped) == ["gen"]
    assert skipped["gen"].startswith("a generator, which does not pickle: TypeError:")
    assert load(payload, None, []) == {"kept": [1, 2]}


def test_a_variable_that_does_not_load_is_named_by_its_mark_not_the_first_one():
    """The pickle's marks say which variable was loading when it failed; an object two
    variables share is blamed on the first that holds it (the next try, without that one,
    blames the other)."""
    shared = _LoadsNowhere(1)
    payload, _ = pack({"before": torch.ones(2), "odd": shared, "after": 3})
    with pytest.raises(NotLoaded) as caught:
        load(payload, None, [])
    assert (caught.value.name, caught.value.why) == ("odd", "ValueError: not here")
    payload, _ = pack({"fine": 1, "holds": {"x": shared}, "odd": shared})
    with pytest.raises(NotLoaded, match="not here") as caught:
        load(payload, None, [])
    assert caught.value.name == "holds"
    payload, _ = pack({"fine": 1})
    assert load(payload, None, []) == {"fine": 1}


def test_a_stand_in_names_the_variable_on_use_but_shows_as_itself():
    stand_in = NotCopied("it", "a generator, which does not pickle")
    assert repr(stand_in) == ("<it: not copied to this rank in a heal (a generator, which does "
                              "not pickle)>")
    for use in (lambda: next(stand_in), lambda: stand_in.x, lambda: stand_in(1),
                lambda: stand_in[0], lambda: len(stand_in), lambda: bool(stand_in)):
        with pytest.raises(NotCopiedError, match=r"^it was not copied to this rank when it "
                                                 r"replaced a dead one \(a generator"):
            use()
    with pytest.raises(NameError):  # except NameError still catches it
        getattr(stand_in, "x")  # noqa: B009 (an attribute read is the use)
