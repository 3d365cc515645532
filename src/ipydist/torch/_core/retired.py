"""Process groups that were replaced (after a release) or destroyed: kept alive, made silent.

A replaced gloo group cannot simply be freed, and must not be left as it is:

- **Kept referenced for the life of the rank.** Freeing a gloo group joins its worker thread
  with the GIL held; if that thread is just finishing work that holds a Python object (every
  allreduce started during backward does), the rank deadlocks (pytorch/pytorch#56297). DDP's
  Reducer can hold the last reference to a group, so the DDP tutorial's ``cleanup()`` followed
  by returning from the demo hangs now and then unless someone else keeps the group alive.
- **Its connections silenced.** A release shuts the group's connections down (on this rank or
  on a peer). gloo's event loop keeps each connection registered in its epoll set until the
  group is freed, and a shut-down connection stays ready for ever: writable with a send that
  can never finish, or readable with bytes for a buffer the aborted collective already freed.
  The loop then wakes without pause and spins a core for the life of the rank (seen: 92 % of a
  core on a rank of a loaded 2-core machine, slowing every rank that shares the core). gloo
  offers no way to stop it, and removing the socket from the epoll set behind gloo's back
  would make its own removal at exit fail an assertion and abort the rank. So each connection
  is re-armed *one-shot with no events*: the kernel then reports it at most once more, and
  never again, while gloo's own removal still finds it registered.
"""

from __future__ import annotations

import ctypes
import os
import platform
import select

#: Groups that were destroyed or replaced (see the module's docstring).
_groups: list = []
#: Their connections given to :func:`silence`, as (fd, inode).
_silenced: set[tuple[int, int | None]] = set()

_EPOLL_CTL_MOD = 3  # (ADD is 1, DEL 2)
_EPOLL_READINESS = (select.EPOLLIN | select.EPOLLOUT | select.EPOLLPRI | select.EPOLLRDHUP)


class _EpollEvent(ctypes.Structure):
    # the kernel's struct epoll_event is packed on x86 (12 bytes), naturally aligned elsewhere
    _pack_ = 1 if platform.machine() in ("x86_64", "i386", "i686") else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def keep(group) -> None:
    """Keep ``group`` referenced for the life of the rank (once, however often it is given)."""
    if group is not None and not any(g is group for g in _groups):
        _groups.append(group)


def inode(fd: int) -> int | None:
    """The inode of the file ``fd`` names now (None if it is closed): with the fd, what says
    that a number still names the same socket."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def silence(sockets: list[tuple[int, int | None]]) -> int:
    """Stop every epoll set of this process from reporting ``sockets`` ((fd, inode) pairs: a
    replaced group's connections), keeping each registration and its data as they are, and
    remember them for :func:`armed`; returns how many registrations were silenced. Linux
    only; elsewhere it does nothing."""
    wanted = set(sockets)
    _silenced.update(wanted)
    if not wanted or not os.path.isdir("/proc/self/fdinfo"):
        return 0
    try:
        epoll_ctl = ctypes.CDLL(None, use_errno=True).epoll_ctl
    except (OSError, AttributeError):
        return 0
    done = 0
    for epfd in _epoll_fds():
        for fd, ino, _, data in _registrations(epfd):
            if (fd, ino) in wanted:
                event = _EpollEvent(select.EPOLLONESHOT, data)
                if epoll_ctl(epfd, _EPOLL_CTL_MOD, fd, ctypes.byref(event)) == 0:
                    done += 1
    return done


def armed(sockets: list[tuple[int, int | None]] | None = None) -> list[int]:
    """The fds of ``sockets`` (default: every socket silenced so far) that some epoll set of
    this process would still report when ready: none, once they are silenced."""
    return sorted(fd for fd, events in _still_registered(sockets) if events & _EPOLL_READINESS)


def registered(sockets: list[tuple[int, int]] | None = None) -> list[int]:
    """The fds of ``sockets`` (default: every socket silenced so far) still open and in some
    epoll set of this process (gloo removes a connection it closed itself)."""
    return sorted(fd for fd, _ in _still_registered(sockets))


def _still_registered(sockets) -> list[tuple[int, int]]:
    wanted = set(_silenced if sockets is None else sockets)
    return [(fd, events) for epfd in _epoll_fds()
            for fd, ino, events, _ in _registrations(epfd) if (fd, ino) in wanted]


def _epoll_fds() -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventpoll]":
                found.append(int(name))
        except OSError:  # closed meanwhile
            pass
    return found


def _registrations(epfd: int) -> list[tuple[int, int | None, int, int]]:
    """(fd, inode, events, data) of each registration in the epoll set ``epfd``, from the
    kernel's fdinfo (lines ``tfd: FD events: HEX data: HEX pos:N ino:HEX sdev:HEX``)."""
    try:
        with open(f"/proc/self/fdinfo/{epfd}") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        words = line.split()
        if len(words) < 6 or words[0] != "tfd:":
            continue
        ino = next((int(w[4:], 16) for w in words[6:] if w.startswith("ino:")), None)
        out.append((int(words[1]), ino, int(words[3], 16), int(words[5], 16)))
    return out
