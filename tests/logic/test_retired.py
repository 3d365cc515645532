"""Silencing a replaced group's connections (``ipydist.torch._core.retired``), against the kernel's
own epoll, set up the way gloo's event loop sets it up: a connected socket registered
level-triggered for input, with the handler's address as its data.

A shut-down socket is ready for ever, so a loop that cannot consume it (gloo's, once the
buffer its bytes were meant for is gone) wakes without pause; after :func:`retired.silence`
it must be reported at most once more, keep its registration and data (gloo removes it
itself when the group is freed, and asserts that the removal succeeds), and never be
reported again.
"""

from __future__ import annotations

import os
import select
import socket
import sys

import pytest

from ipydist.torch._core import retired

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="epoll, /proc")

HANDLER = 0x7F00DEADBEE0  # what gloo stores: the address of the pair's handler


@pytest.fixture
def ready_for_ever():
    """(epoll fd, socket, its peer): the socket registered as gloo registers a pair, with
    unread bytes and shut down, so it is ready on every wait."""
    ours, peer = socket.socketpair()
    peer.sendall(b"bytes for a buffer that no longer exists")
    ours.shutdown(socket.SHUT_RDWR)
    epfd = select.epoll()
    event = retired._EpollEvent(select.EPOLLIN, HANDLER)
    assert _epoll_ctl(epfd.fileno(), 1, ours.fileno(), event) == 0  # EPOLL_CTL_ADD
    yield epfd, ours, peer
    epfd.close()
    ours.close()
    peer.close()


def _epoll_ctl(epfd: int, op: int, fd: int, event) -> int:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).epoll_ctl(epfd, op, fd, ctypes.byref(event))


def _reports(epfd, times: int = 20) -> int:
    return sum(bool(epfd.poll(0.001)) for _ in range(times))


def test_a_shut_down_socket_is_reported_on_every_wait_until_silenced(ready_for_ever):
    epfd, ours, _ = ready_for_ever
    assert _reports(epfd) == 20, "the setup must reproduce the spin"
    me = (ours.fileno(), retired.inode(ours.fileno()))
    assert retired.armed([me]) == [ours.fileno()]

    assert retired.silence([me]) == 1
    assert _reports(epfd) <= 1
    assert _reports(epfd) == 0
    assert retired.armed([me]) == [] and retired.registered([me]) == [ours.fileno()]
    [data] = [r[3] for r in retired._registrations(epfd.fileno()) if r[0] == ours.fileno()]
    assert data == HANDLER, "gloo's handler address must be kept"
    epfd.unregister(ours.fileno())  # gloo's own removal when the group is freed still works


def test_only_the_same_socket_is_silenced_when_its_number_was_reused(ready_for_ever):
    epfd, ours, _ = ready_for_ever
    stale = (ours.fileno(), retired.inode(ours.fileno()) + 1)  # the number now names another
    assert retired.silence([stale]) == 0
    assert _reports(epfd) == 20


def test_nothing_to_silence_is_fine():
    assert retired.silence([]) == 0
    assert retired.armed([]) == [] and retired.registered([]) == []
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    assert retired.inode(closed) is None
