"""A rank's engine reads its connection file only once the controller has written all of it
(``ipydist.rank.engine``): ipyparallel's controller writes it in place, and under load a rank
read it empty and failed its start."""

from __future__ import annotations

import json
import threading
import time

from ipydist.rank.engine import RankEngine

CONNECTION = {"interface": "tcp://127.0.0.1", "location": "127.0.0.1", "ssh": "",
              "key": "k", "signature_scheme": "hmac-sha256", "registration": 12345,
              "pack": "json", "unpack": "json"}


def _write_late(path, delay: float) -> threading.Thread:
    def write():
        time.sleep(delay)
        with open(path, "w") as f:
            f.write(json.dumps(CONNECTION, indent=2))

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def test_an_engine_reads_a_connection_file_written_after_it_appeared(tmp_path):
    path = tmp_path / "ipcontroller-engine.json"
    path.write_text("")  # the controller has opened it, and not yet written
    engine = RankEngine(url_file=str(path), wait_for_url_file=10)
    writer = _write_late(path, 0.3)
    try:
        engine.load_connection_file()  # ipyparallel's own read raised JSONDecodeError here
    finally:
        writer.join()
    assert engine.location == "127.0.0.1"


def test_a_file_never_whole_fails_as_ipyparallel_s_read_does_once_the_wait_is_over(tmp_path):
    path = tmp_path / "ipcontroller-engine.json"
    path.write_text('{"interface": ')
    engine = RankEngine(url_file=str(path), wait_for_url_file=0.5)
    t0 = time.monotonic()
    try:
        engine.load_connection_file()
    except ValueError:
        pass
    else:
        raise AssertionError("a file that is never whole was read")
    assert 0.5 <= time.monotonic() - t0 < 5
