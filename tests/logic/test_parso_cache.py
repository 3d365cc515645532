"""A rank writes parso's cache (jedi's, shared by every Python of the user) whole or not at all
(``ipydist.rank.introspection.completion.save_parso_cache_atomically``): a rank ended while it
warmed jedi up once left an empty file there, and every kernel on the machine then completed
nothing."""

from __future__ import annotations

import os
import pickle

import pytest
from parso import cache

from ipydist.rank.introspection import completion

REAL_DUMP = pickle.dump


class Ended(BaseException):
    """A rank's end in the middle of a write."""


@pytest.fixture
def atomic(monkeypatch):
    monkeypatch.setattr(cache, "_save_to_file_system", cache._save_to_file_system)  # restored
    completion.save_parso_cache_atomically()
    completion.save_parso_cache_atomically()  # once is enough: the second call keeps it
    assert cache._save_to_file_system.atomic


def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path, monkeypatch, atomic):
    cache._save_to_file_system("grammar", "/a/module.py", {"parsed": 1}, cache_path=tmp_path)
    target = cache._get_hashed_path("grammar", "/a/module.py", cache_path=tmp_path)

    def dump_then_end(item, f, protocol):
        f.write(b"\x80\x05half a pickle")
        raise Ended

    monkeypatch.setattr(pickle, "dump", dump_then_end)
    with pytest.raises(Ended):
        cache._save_to_file_system("grammar", "/a/module.py", {"parsed": 2}, cache_path=tmp_path)
    monkeypatch.setattr(pickle, "dump", REAL_DUMP)
    with open(target, "rb") as f:
        assert pickle.load(f) == {"parsed": 1}
    assert os.listdir(os.path.dirname(target)) == [os.path.basename(target)], "nothing left"


def test_parso_reads_what_the_rank_wrote(tmp_path, atomic):
    item = cache._NodeCacheItem("a node", ["line\n"], change_time=1.0)
    cache._save_to_file_system("grammar", "/b/module.py", item, cache_path=tmp_path)
    loaded = cache._load_from_file_system("grammar", "/b/module.py", 0.0, cache_path=tmp_path)
    assert loaded == "a node"
