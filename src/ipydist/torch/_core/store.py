"""The rendezvous store every process group of a cluster meets in, made once per rank.

On one host it is a ``FileStore`` in a directory only this user can enter (0700): no port at
all, so nothing on the machine's network can read or write the rendezvous keys. torch's
TCPStore would listen on every interface, unauthenticated, whatever address it is given.
Across hosts a file would need a filesystem every host shares and locks on it, so it is a
TCPStore: rank 0 listens on a free port and tells the others over MPI; its address is the
one on the network the hosts share (see ``ipydist.rank.start.bootstrap``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import shutil
import tempfile

import torch.distributed as dist

from ipydist.protocol import RENDEZVOUS_PARENT_ENV


def make_store(rt, timeout_s: float):
    """The store for runtime ``rt`` (collective over ``rt.comm`` when there is one)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rt.comm is None:
        if rt.size == 1 and not rt.master_port:
            return dist.TCPStore(rt.master_addr, 0, 1, True, timeout=timeout)
        return dist.TCPStore(
            rt.master_addr, rt.master_port, rt.size, rt.rank == 0, timeout=timeout
        )
    if rt.one_host and not os.environ.get("IPYDIST_MASTER_ADDR"):
        return _file_store(rt, timeout)
    return _tcp_store(rt, timeout)


def _file_store(rt, timeout: datetime.timedelta):
    """Rank 0 makes a private directory (removed when it exits) and tells the others."""
    path = None
    if rt.rank == 0:
        try:
            parent = os.environ.get(RENDEZVOUS_PARENT_ENV)  # removed with the cluster
            if parent and not os.path.isdir(parent):
                parent = None
            folder = tempfile.mkdtemp(prefix="ipydist-rendezvous-", dir=parent)  # mode 0700
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            path = os.path.join(folder, "store")
        except OSError:
            rt.comm.bcast("", root=0)  # the others must not wait for a path that never comes
            raise
    path = rt.comm.bcast(path, root=0)
    if not path:
        raise RuntimeError("rank 0 could not make the rendezvous directory")
    store = dist.FileStore(path, rt.size)
    store.set_timeout(timeout)
    rt.master_port = 0
    rt.store_path = path
    return store


def _tcp_store(rt, timeout: datetime.timedelta):
    """Rank 0 listens on a free port and tells the others over MPI."""

    def share_port(port: int) -> int:
        return rt.comm.bcast(port, root=0)

    store = None
    port = 0
    if rt.rank == 0:
        try:
            store = dist.TCPStore(
                rt.master_addr, 0, rt.size, True, timeout=timeout, wait_for_workers=False
            )
            port = store.port
        except Exception:
            share_port(-1)  # the others must not wait for a port that will never come
            raise
    port = share_port(port)
    if port < 0:
        raise RuntimeError("rank 0 could not open the rendezvous store")
    if rt.rank != 0:
        store = dist.TCPStore(rt.master_addr, port, rt.size, False, timeout=timeout)
    rt.master_port = port
    return store
