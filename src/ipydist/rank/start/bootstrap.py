"""Setting a rank up before it becomes an ipyparallel engine: watcher, topology, threads,
device, torchrun variables, process group.

A rank that cannot start prints one line beginning ``protocol.ERROR_PREFIX``
(``ipydist: rank N on HOST: ...``) and every rank exits non-zero, so mpiexec ends and
``%dist_start`` shows that line instead of waiting. A rank that gets past a slow step (torch
imported, process group made) prints a marker line (``protocol.phase_line``), so that
``%dist_start`` can show how far the ranks are.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from ipydist import protocol
from ipydist.errors import LaunchError
from ipydist.rank import channel, device, ending, watcher
from ipydist.rank.healing import spares
from ipydist.rank.start import replacement
from ipydist.specs import SpecError, parse_gpus


def bootstrap(env: dict[str, str] | None = None):
    """Set up this rank from the :class:`~ipydist.protocol.RankConfig` in its environment."""
    watcher.install()  # first: its signal must be blocked in every thread started later
    end_with_launcher()  # a rank whose launcher died ends: nothing else would end it
    replacement.take_environment(sys.argv)  # a replacement's, from the rank that spawned it
    config = protocol.RankConfig.from_env(env)
    from mpi4py import MPI  # after the watcher: MPI_Init may start threads

    replaces = replacement.take_replaced_ranks(sys.argv)  # a spawned rank: the one it takes
    later = replacement.take_later_ranks(sys.argv)
    global joined_late
    joined_late = bool(replaces)
    comm = replacement.world(MPI, replaces, later) if replaces else MPI.COMM_WORLD
    if config.spares and not replaces:
        comm = spares.split_at_start(comm, config.spares)
        if comm == MPI.COMM_NULL:  # a spare: it waits until a heal needs it
            joined_late = True
            comm = spares.wait_for_turn()
            if comm is None:  # the job ended first
                ending.exit_now(0)
    return join(comm, config)


#: Whether this rank joined the world after the job's start (a spawned replacement, a hot
#: spare that took a rank's place), as its engine needs to know (``rank.engine``).
joined_late = False


def join(comm, config: protocol.RankConfig | None = None, survivor=None):
    """This rank's runtime and process group in the world ``comm`` (collective: every rank
    of it calls this, in the same steps). ``survivor``: the runtime of a rank that outlived
    another (see :mod:`ipydist.rank.healing.heal`), whose device, threads and hooks stay as
    they are; None for a rank starting."""
    from mpi4py import MPI

    config = config or protocol.RankConfig.from_env()
    problem = None
    try:
        gpus = parse_gpus(config.gpus)
    except SpecError as e:
        gpus, problem = "none", str(e)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    own_gpus, local_rank, local_size = _this_host(comm, MPI, inherited)
    if survivor is None:
        os.environ.setdefault("CUDA_DEVICE_ORDER", device.DEVICE_ORDER)
        try:  # before torch touches CUDA
            visible = device.visible_for_rank(
                gpus, inherited, config.gpus_per_rank, local_rank, local_size, own_gpus,
                device.host_gpu_count() if config.gpus_per_rank > 1 else 0)
        except LaunchError as e:
            visible, problem = "", problem or str(e)
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    if config.gpus_per_rank > 1:  # the rank's own GPUs, from its first: planned as given
        gpus, own_gpus = "auto", True

    import torch  # after the watcher and CUDA_VISIBLE_DEVICES

    from ipydist.torch._core import gpu_sharing, process_group, shims, topology
    from ipydist.torch.training import metrics

    if survivor is None:
        _reached(comm.Get_rank(), protocol.PHASE_TORCH)
    meet_without_spinning(comm)  # the slowest torch import (a replacement's) gets the cores
    rt = topology.from_mpi(comm, advertise=_use_route_to(config.notebook_addr))
    if survivor is None:
        # OMP_NUM_THREADS from the user (--env) wins; otherwise share the host's cores.
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or device.threads_per_rank(
            os.cpu_count() or 1, rt.local_size, len(os.sched_getaffinity(0))
        )
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes the rank starts
    rt.timeout_s = config.pg_timeout
    if survivor is not None:
        rt.device_index, rt.gpu_sharing = survivor.device_index, survivor.gpu_sharing
    elif problem is None:
        try:
            count = torch.cuda.device_count() if gpus != "none" else 0
            rt.device_index = device.plan_device(
                gpus, rt.local_rank, rt.local_size, count, config.backend, own_gpus)
            if rt.device_index is not None:
                torch.cuda.set_device(rt.device_index)
                rt.gpu_sharing = _share_gpus(rt, count, config.backend, own_gpus)
        except (LaunchError, RuntimeError) as e:
            problem = str(e)
    # one collective: whether any rank failed, and the backend each would use
    wish = gpu_sharing.resolve_backend(config.backend, rt.device_index, rt.gpu_sharing)
    gathered = comm.allgather((problem, wish, survivor.backend if survivor else None))
    _fail_all([p for p, _, _ in gathered], rt.rank, rt.host, problem)
    rt.backend = device.agree_backend([w for _, w, _ in gathered], [k for _, _, k in gathered])
    topology.set_runtime(rt)
    if comm != MPI.COMM_WORLD:
        # mpi4py's world, as a cell sees it, is the ranks': with hot spares the job's world
        # holds them too (a collective on it would wait for them for ever), and after a heal
        # the job's holds the dead rank (a replacement's, only itself)
        setattr(MPI, "COMM_WORLD", comm)  # noqa: B010 (a Final to mypy, a plain name here)
    if survivor is None:
        shims.install_reuse_shim()
        if rt.gpu_sharing:
            shims.install_shared_gpu_shim()
        shims.track_ddp_models()
        watcher.break_communication_with(process_group.break_communication)
        metrics.send_with(channel.publish)
    if config.init:
        try:
            process_group.make(rt)
        except Exception as e:  # the backend's own message is the useful part
            if survivor is not None:
                raise
            print(
                f"{protocol.ERROR_PREFIX} {rt.rank} on {rt.host}: could not create the "
                f"{rt.backend} process group: {e}",
                file=sys.stderr,
                flush=True,
            )
            comm.Abort(1)
        if survivor is None:
            _reached(rt.rank, protocol.PHASE_GROUP)
    else:
        rt.master_port = comm.bcast(_free_port(rt.master_addr) if rt.rank == 0 else 0, root=0)
        topology.export_torchrun_env(rt)
        if survivor is None:
            _reached(rt.rank, protocol.PHASE_ENV)
    return rt


#: How long a rank sleeps between two looks at whether its peers have reached it
#: (:func:`meet_without_spinning`).
MEET_POLL_SECONDS = 0.01


def meet_without_spinning(comm) -> None:
    """Wait until every rank of ``comm`` is here, asleep between looks (collective). MPI's
    blocking calls spin while they wait, so a rank far behind found its peers on its cores:
    in a heal on 2 cores, the survivors took 100% of both while the replacement imported
    torch at 40% (issue 46); at a start, the ranks whose import ended first took the cores
    of the slowest."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(MEET_POLL_SECONDS)


def _this_host(comm, mpi, inherited: str | None) -> tuple[bool, int, int]:
    """(whether each rank on this host was given GPUs of its own, this rank's index among the
    host's ranks, their number), before torch is imported (collective: the host's ranks
    compare what ``CUDA_VISIBLE_DEVICES`` they inherited)."""
    local = comm.Split_type(mpi.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return device.own_gpus(local.allgather(inherited)), local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _share_gpus(rt, count: int, backend: str, own_gpus: bool) -> str:
    """How this rank's CUDA tensors travel when the host's ranks share its GPUs ("" when each
    has its own), with NCCL's environment set for it before any communicator is made."""
    from ipydist.torch._core import gpu_sharing, process_group

    way, env = gpu_sharing.plan_sharing(rt.local_size, count, backend, own_gpus,
                                   process_group.nccl_version(), rt.host, rt.local_rank)
    os.environ.update(env)
    return way


def _use_route_to(notebook_addr: str) -> str | None:
    """Across hosts: gloo uses this host's interface that reaches the notebook host (unless
    the user set theirs), and this rank's address there is what it offers as the rendezvous
    address. On one host (no address given): None. NCCL is left to choose its own: that
    route may be a management network, where NCCL prefers InfiniBand or the fastest NIC
    (``NCCL_SOCKET_IFNAME`` still sets one)."""
    if not notebook_addr:
        return None
    from ipydist import network

    try:
        route = network.route_to(notebook_addr)
    except OSError:
        return None  # the rendezvous falls back to the host's name
    os.environ.setdefault("GLOO_SOCKET_IFNAME", route.interface)
    return route.address


def _reached(rank: int, phase: str) -> None:
    """Tell the notebook that this rank got past ``phase``: one marker line on stdout, which
    mpiexec forwards from any host. Only a progress report: a stdout that fails is ignored."""
    try:
        sys.stdout.write(protocol.phase_line(rank, phase) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _fail_all(problems: list[str | None], rank: int, host: str, problem: str | None) -> None:
    """If any rank has a problem (``problems``: every rank's), each one with a problem says
    so, and all exit."""
    if not any(problems):
        return
    if problem:
        print(f"{protocol.ERROR_PREFIX} {rank} on {host}: {problem}", file=sys.stderr,
              flush=True)
    sys.exit(1)


def _free_port(addr: str) -> int:
    """A port free now, for ``--no-init`` clusters whose user code rendezvous by itself."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


#: How often a rank looks at its parent (:func:`end_with_launcher`): a lost launcher's ranks
#: end within this (and a rank's nanny, which watches its rank, right after).
LAUNCHER_POLL_SECONDS = 0.5


def end_with_launcher(poll: float = LAUNCHER_POLL_SECONDS) -> int:
    """End this rank as soon as the process that launched it is gone; returns its pid.

    Every rank is the child of its launcher's process on its host: mpiexec (Open MPI's
    ``prterun``, MPICH's ``mpiexec.gforker``) on the notebook's host, the launcher's daemon
    (``prted``, ``hydra_pmi_proxy``) on another, ``slurmstepd`` under srun. The launcher ends
    its ranks when it ends the job, but it can die first (killed, crashed, or ended by Slurm
    while ranks waited in MPI's finalize): its ranks are then re-parented, and nothing would end
    them. Slurm's ``proctrack/linuxproc`` finds a step's processes by their parents, so it no
    longer sees them either: a rank and its nanny were seen on a node 10 s after their job had
    ended (issue 46). So each rank polls its parent's pid in a thread. Not
    ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the parent *thread* that
    forked the rank ends, and a launcher may fork from a thread that ends before the job.
    A rank forked by this host's fork server watches the process its launcher started instead
    (:func:`ipydist.rank.start.forkserver.watch_stub`).
    """
    from ipydist.rank.start import forkserver

    if forkserver.lifeline is not None:
        forkserver.watch_stub(_say_launcher_gone)
        assert forkserver.stub_pid is not None  # set with lifeline (forkserver._become)
        return forkserver.stub_pid
    parent = os.getppid()
    threading.Thread(target=_watch_launcher, args=(parent, poll), daemon=True,
                     name="ipydist-launcher-watch").start()
    return parent


def _watch_launcher(parent: int, poll: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll)
    _say_launcher_gone(parent)
    os._exit(1)


def _say_launcher_gone(launcher: int) -> None:
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "?"
    try:
        sys.stderr.write(f"ipydist: rank {rank} (pid {os.getpid()}) ends: its launcher (pid "
                         f"{launcher}) is gone, so its job is over.\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
