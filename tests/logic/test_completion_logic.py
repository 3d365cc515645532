"""Which code of a cell rank 0 completes, and how its answers are put back into the cell
(pure logic of ``ipydist.notebook.introspection.completion``)."""

from __future__ import annotations

from ipydist.notebook.introspection.completion import answering_rank, headed, rank_code, shifted

CELL = "%%everyrank --ranks 0\nmodel.para"


def test_the_body_of_an_everyrank_cell_goes_to_rank_0_with_its_offset():
    body, offset = rank_code(CELL, len(CELL), everyrank_mode=False)
    assert body == "model.para" and offset == len("%%everyrank --ranks 0\n")
    assert rank_code("\n  " + CELL, len(CELL) + 3, False) == ("model.para", len(CELL) - 7)


def test_the_magic_line_and_other_cells_stay_with_the_notebook():
    assert rank_code(CELL, len("%%everyrank --ra"), False) is None  # its options
    assert rank_code("%%everyrank", 11, False) is None
    assert rank_code("x = mod", 7, False) is None
    assert rank_code("x = mod", 7, everyrank_mode=True) == ("x = mod", 0)
    assert rank_code("%dist_status", 6, everyrank_mode=True) is None


def test_positions_move_back_into_the_cell():
    reply = {"matches": ["parameters"], "cursor_start": 6, "cursor_end": 10, "status": "ok",
             "metadata": {"_jupyter_types_experimental": [
                 {"start": 6, "end": 10, "text": "parameters", "type": "function"}]}}
    moved = shifted(reply, 22)
    assert (moved["cursor_start"], moved["cursor_end"]) == (28, 32)
    assert moved["metadata"]["_jupyter_types_experimental"][0]["start"] == 28
    assert reply["cursor_start"] == 6, "the rank's reply is left as it was"


def test_help_names_the_rank():
    found = headed({"text/plain": "Linear(...)", "text/html": "<pre>Linear</pre>"}, 2)
    assert found["text/plain"] == "[rank 2]\nLinear(...)"
    assert found["text/html"].startswith("<p><b>rank 2</b></p>")


def test_the_first_of_the_cells_ranks_answers():
    assert answering_rank("%%everyrank\nmodel.", 4) == 0
    assert answering_rank("%%everyrank --ranks 2-3\nmodel.", 4) == 2
    assert answering_rank("%%everyrank --output rank0 --ranks=3\nx", 4) == 3
    assert answering_rank("model.", 4) == 0, "%dist_mode everyrank: every rank"
    assert answering_rank("%%everyrank --ranks 9\nx", 4) == 0, "a wrong spec: rank 0"
    assert answering_rank("%%everyrank\nf('--ranks 3')", 4) == 0, "only the magic's line"


def test_a_rank_waits_longer_for_its_first_answer_while_jedi_loads(monkeypatch):
    """The first completion on a rank loads jedi (past the usual limit on a loaded machine:
    the first Tab after a start came back empty); later ones get the usual limit."""
    import threading
    import time

    from ipydist.rank.introspection import completion as on_rank

    monkeypatch.setattr(on_rank, "_answered", threading.Event())
    monkeypatch.setattr(on_rank, "ANSWER_SECONDS", 0.2)
    monkeypatch.setattr(on_rank, "FIRST_ANSWER_SECONDS", 3.0)

    def slow_reply(request):
        time.sleep(0.6)
        return {"status": "ok", "matches": [request["code"]]}

    monkeypatch.setattr(on_rank, "_reply", slow_reply)
    first = on_rank.answer({"what": "complete", "code": "a", "cursor_pos": 1})
    assert first == {"reply": {"status": "ok", "matches": ["a"]}}
    assert on_rank.answer({"what": "complete", "code": "b", "cursor_pos": 1}) == {"busy": True}
    assert on_rank._lock.acquire(timeout=5), "the late worker ends in its own time"
    on_rank._lock.release()


def test_a_rank_that_does_not_answer_gives_nothing_not_the_notebooks_names(monkeypatch):
    """Code on the ranks never gets the notebook's completion (its names are not the ranks'):
    CI once offered the notebook's ``notebook_only_name`` in an ``%%everyrank`` cell when rank
    0 was slow. The notebook still answers for its own cells."""
    from types import SimpleNamespace

    from ipydist.notebook.introspection import completion, control

    def local_complete(code, cursor_pos):
        return {"status": "ok", "matches": ["notebook_only_name"], "cursor_start": 0,
                "cursor_end": cursor_pos, "metadata": {}}

    def local_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        return {"status": "ok", "found": True, "data": {"text/plain": "the notebook's"},
                "metadata": {}}

    kernel = SimpleNamespace(do_complete=local_complete, do_inspect=local_inspect)
    cluster = SimpleNamespace(engine_ids=[0, 1])
    magics = SimpleNamespace(mode="local", session=SimpleNamespace(
        running=True, size=2, cluster=cluster))
    asked = []
    monkeypatch.setattr(control, "ask_ranks",
                        lambda cluster, ranks, request, timeout: asked.append(timeout) or {0: None})
    hooks = {}
    events = SimpleNamespace(register=lambda name, hook: hooks.setdefault(name, hook))
    completion.install(SimpleNamespace(kernel=kernel, events=events), magics)
    cell = "%%everyrank\nnotebook_only_na"
    reply = kernel.do_complete(cell, len(cell))
    assert reply["matches"] == [] and reply["cursor_start"] == reply["cursor_end"] == len(cell)
    assert not kernel.do_inspect(cell, len(cell))["found"]
    assert asked == [completion.FIRST_ANSWER_SECONDS] * 2, "no answer yet: the long wait"
    assert kernel.do_complete("notebook_only_na", 16)["matches"] == ["notebook_only_name"]

    # after a cell, rank 0 of a cluster is asked once to load its completer
    told = []
    monkeypatch.setattr(control, "tell_rank", lambda c, rank, request: told.append((rank, request)))
    hooks["post_run_cell"](None)
    hooks["post_run_cell"](None)
    assert told == [(0, {"what": "warm"})]
    cluster.engine_ids = [5, 1]  # a new rank 0 (a heal): asked again
    hooks["post_run_cell"](None)
    assert len(told) == 2


def test_a_warmed_rank_answers_its_first_question_in_the_usual_time(monkeypatch):
    """The warm-up loads jedi in the background; a question asked meanwhile waits for it (not
    "busy" at once), and one after it gets the usual limit."""
    import threading
    import time

    from ipydist.rank.introspection import completion as on_rank

    monkeypatch.setattr(on_rank, "_answered", threading.Event())
    monkeypatch.setattr(on_rank, "FIRST_ANSWER_SECONDS", 3.0)
    asked = []

    def reply(request):
        asked.append(request["code"])
        time.sleep(0.2)
        return {"status": "ok", "matches": [request["code"]]}

    monkeypatch.setattr(on_rank, "_reply", reply)
    assert on_rank.warm() == {"warming": True}
    assert on_rank.warm() == {"warming": False}, "one warm-up at a time"
    during = on_rank.answer({"what": "complete", "code": "mod", "cursor_pos": 3})
    assert during == {"reply": {"status": "ok", "matches": ["mod"]}}
    assert asked[-1] == "mod" and len(asked) >= 3, asked
    assert on_rank._answered.is_set()
    assert on_rank.warm() == {"warming": False}, "loaded already"
