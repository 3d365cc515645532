"""``%dist_stack``'s view: every rank's stack, collapsed where ranks agree (pure logic)."""

from __future__ import annotations

from ipydist.notebook.introspection.debugging import Breakpoints, collapse

IN_ALLREDUCE = {"state": "running", "collective": "all_reduce",
                "frames": [["allreduce_", "collectives.py:72"], ["train", "cell 5, line 14"]]}
LOADING = {"state": "running", "collective": None,
           "frames": [["load_batch", "cell 5, line 9"], ["train", "cell 5, line 14"]]}


def test_ranks_that_agree_share_a_line_innermost_frame_first():
    text = collapse({0: IN_ALLREDUCE, 1: IN_ALLREDUCE, 2: IN_ALLREDUCE, 3: LOADING,
                     4: IN_ALLREDUCE, 5: IN_ALLREDUCE})
    assert text.splitlines() == [
        "ranks 0-2 and 4-5: waiting in all_reduce: allreduce_ (collectives.py:72)",
        "    ← train (cell 5, line 14)",  # wrapped at 88 columns, as ipydist's messages are
        "rank 3: running: load_batch (cell 5, line 9) ← train (cell 5, line 14)",
    ]


def test_idle_at_a_prompt_and_silent_ranks():
    text = collapse({0: {"state": "idle", "frames": [], "collective": None},
                     1: {"state": "debugger", "collective": None,
                         "frames": [["<cell>", "cell 2, line 3"]]},
                     2: None, 3: None})
    assert text.splitlines() == ["rank 0: idle (no cell running)",
                                 "rank 1: at a pdb prompt: <cell> (cell 2, line 3)",
                                 "ranks 2-3: no answer within 2 s"]


def test_a_prompt_found_twice_is_asked_once():
    """A rank's debugger message can arrive twice (its own, and the request's metadata)."""
    desk = Breakpoints(cluster=None, before_output=lambda: None)
    prompt = {"seq": 1, "rank": 2, "output": "> cell\n", "prompt": "(Pdb rank 2) "}
    desk.accept(2, prompt)
    desk.accept(2, dict(prompt))
    desk.accept(1, {"seq": 1, "rank": 1, "output": "", "prompt": "(Pdb rank 1) "})
    assert [rank for rank, _ in desk.waiting] == [2, 1]


def test_dist_debug_commands_lose_the_quotes_that_kept_them_whole():
    from ipydist.notebook.introspection.debugging import unquoted

    assert unquoted(['"p t"', "w", "'p x[\"a\"]'"]) == ["p t", "w", 'p x["a"]']
    assert unquoted(None) is None
