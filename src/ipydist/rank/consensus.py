"""One verdict for every rank, reached over MPI with a deadline: how recovery decides together.

After a failed or interrupted cell the ranks must all rebuild their process group, or none
must; a rank that decides alone waits for peers that never come (torch's rendezvous waits ten
minutes). The process group cannot carry that decision: a release has just broken it. MPI can,
since a release never touches it. But a blocking MPI collective waits forever for a rank that
never arrives, so :func:`decide` uses point-to-point messages through rank 0, polled against a
deadline: every rank sends rank 0 its vote, rank 0 answers each with the verdict, and a rank
that hears nothing by its deadline gives up on its own -- so every rank leaves :func:`decide`
by its deadline, whatever the others do.

Messages travel on a communicator of their own (made once at start), tagged with the
recovery's number (the notebook counts them) and the step within it, so a vote a late rank
sent after the others gave up can never be mistaken for one of a later recovery.
"""

from __future__ import annotations

import time

import numpy as np

#: The largest tag every MPI implementation accepts is 32767; tags cycle below it.
_TAG_SPACE = 32000
#: Steps of one recovery (each :func:`decide` call within it has its own).
STEPS = 8
#: Rank 0 decides by the deadline; the others wait this much longer for its verdict, so a
#: verdict sent at the last moment still arrives.
ANSWER_SLACK_SECONDS = 3.0
_POLL_SECONDS = 0.002


def tag(recovery: int, step: int) -> int:
    return (recovery * STEPS + step) % _TAG_SPACE


def decide(comm, recovery: int, step: int, vote: list[int],
          deadline: float) -> list[list[int]] | None:
    """Every rank's ``vote`` (a few ints, the same count on every rank), in rank order, the
    same list on every rank -- or None on a rank that did not hear from all in time.

    Rank 0 waits for the votes until ``deadline`` (``time.monotonic()``); a vote that comes
    later counts as missing, and rank 0's answer is then None for all. The others wait for the
    answer until ``deadline + ANSWER_SLACK_SECONDS``.
    """
    _reap()
    t = tag(recovery, step)
    size, me = comm.Get_size(), comm.Get_rank()
    mine = np.asarray(vote, dtype=np.int64)
    width = mine.size
    if me != 0:
        _send(comm, mine, 0, t)
        answer = np.empty(1 + size * width, dtype=np.int64)
        got = _wait([comm.Irecv(answer, source=0, tag=t)], deadline + ANSWER_SLACK_SECONDS)
        if not got or not answer[0]:
            return None
        return answer[1:].reshape(size, width).tolist()
    votes = np.empty((size, width), dtype=np.int64)
    votes[0] = mine
    heard = _wait([comm.Irecv(votes[r], source=r, tag=t) for r in range(1, size)], deadline)
    heard = heard and time.monotonic() <= deadline
    answer = np.concatenate([[1 if heard else 0], votes.reshape(-1)]).astype(np.int64)
    for r in range(1, size):
        _send(comm, answer, r, t)
    return votes.tolist() if heard else None


def _wait(requests, deadline: float) -> bool:
    """Whether every request completed by ``deadline``; those that did not are cancelled."""
    from mpi4py import MPI

    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            for request in requests:
                if request != MPI.REQUEST_NULL:
                    request.Cancel()
                    request.Wait()  # at once: cancelled, or the message that just came
            return False
        time.sleep(_POLL_SECONDS)
    return True


#: Sends still in flight, with their buffers: MPI reads a buffer until its send completes.
_in_flight: list = []


def _send(comm, buffer, dest: int, tag_: int) -> None:
    """Send without waiting for the receiver (who may have given up: the send stays pending)."""
    _in_flight.append((comm.Isend(buffer, dest=dest, tag=tag_), buffer))


def _reap() -> None:
    """Forget the sends that completed."""
    _in_flight[:] = [(r, b) for r, b in _in_flight if not r.Test()]
