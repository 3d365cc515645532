"""Bootstrap that runs on every rank at start, before the rank becomes an ipyparallel engine.

mpiexec starts ``python -m ipydist.engine ...`` on each rank. The heavy work (importing torch,
pinning the GPU, the process-group rendezvous) happens here, while the notebook side is still
starting the controller, so the first cell can run as soon as the engines register. The
remaining arguments go to ipyparallel's own engine unchanged.

A rank that cannot start prints one line beginning ``ipydist: rank N`` and every rank exits
non-zero, so mpiexec ends and ``%dist_start`` shows that line instead of waiting.
"""

from __future__ import annotations

import os
import sys

from ipydist import launch


def _fail_all(comm, rank: int, host: str, problem: str | None) -> None:
    """Collective: if any rank has a problem, each one with a problem says so, and all exit."""
    problems = comm.allgather(problem)
    if not any(problems):
        return
    if problem:
        print(f"{launch.ERROR_PREFIX} {rank} on {host}: {problem}", file=sys.stderr, flush=True)
    sys.exit(1)


def bootstrap(env: dict[str, str] | None = None):
    """Set up this rank: topology, threads, device, torchrun variables, process group."""
    env = os.environ if env is None else env
    from ipydist import release

    release.install()  # first: its signal must be blocked in every thread started later
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    problem = None
    try:
        gpus = launch.parse_gpus(env.get("IPYDIST_GPUS", "auto"))
    except launch.LaunchError as e:
        gpus, problem = "none", str(e)
    if isinstance(gpus, list):  # before torch touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = launch.format_gpus(gpus)

    import torch

    from ipydist.torch import runtime

    rt = runtime.topology_from_mpi(comm)
    # OMP_NUM_THREADS from the user (--env) wins; otherwise share the host's cores.
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or launch.threads_per_rank(
        os.cpu_count() or 1, rt.local_size
    )
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes the rank starts
    rt.timeout_s = float(env.get("IPYDIST_PG_TIMEOUT", "600"))
    backend = env.get("IPYDIST_BACKEND", "auto")
    if problem is None:
        try:
            count = torch.cuda.device_count() if gpus != "none" else 0
            rt.device_index = launch.plan_device(gpus, rt.local_rank, rt.local_size, count, backend)
            if rt.device_index is not None:
                torch.cuda.set_device(rt.device_index)
        except (launch.LaunchError, RuntimeError) as e:
            problem = str(e)
    _fail_all(comm, rt.rank, rt.host, problem)

    rt.backend = launch.resolve_backend(backend, rt.device_index)
    runtime.set_runtime(rt)
    runtime.install_reuse_shim()
    if env.get("IPYDIST_INIT", "1") == "1":
        try:
            runtime.init_process_group(rt)
        except Exception as e:  # the backend's own message is the useful part
            print(
                f"{launch.ERROR_PREFIX} {rt.rank} on {rt.host}: could not create the {rt.backend} "
                f"process group: {e}",
                file=sys.stderr,
                flush=True,
            )
            comm.Abort(1)
    else:
        rt.master_port = comm.bcast(_free_port(rt.master_addr) if rt.rank == 0 else 0, root=0)
        runtime.export_torchrun_env(rt)
    return rt


def _free_port(addr: str) -> int:
    """A port free now, for ``--no-init`` clusters whose user code rendezvous by itself."""
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_info() -> dict:
    """What the notebook shows about this rank; called through ipyparallel after start."""
    import socket

    import torch.distributed as dist

    from ipydist.torch import runtime

    rt = runtime.get()
    info = {
        "rank": rt.rank,
        "size": rt.size,
        "local_rank": rt.local_rank,
        "local_size": rt.local_size,
        "host": rt.host or socket.gethostname(),
        "pid": os.getpid(),
        "device": str(rt.device),
        "backend": rt.backend if dist.is_initialized() else "(none)",
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "nanny_pid": None,
    }
    try:
        from ipyparallel.engine.app import IPEngine

        if IPEngine.initialized() and getattr(IPEngine.instance(), "nanny_pipe", None):
            info["nanny_pid"] = IPEngine.instance().nanny_pipe.pid
    except Exception:
        pass
    return info


def publish(key: str, value) -> None:
    """Send ``{key: value}`` to the notebook as an ipyparallel data message: on the rank's
    signed IOPub channel, so no new port; tagged with the running cell's request. Safe from
    any thread (ipykernel's IOPub thread does the sending). Does nothing off an engine."""
    try:
        from ipyparallel.datapub import publish_data

        publish_data({key: value})
    except Exception:  # not on an engine (a plain script under mpiexec)
        pass


def main(argv: list[str] | None = None) -> None:
    bootstrap()
    from ipyparallel.engine.app import IPEngine

    IPEngine.launch_instance(argv)


if __name__ == "__main__":
    # Run the copy imported as ``ipydist.engine`` so its functions are the ones clients call.
    from ipydist.engine import main as _main

    _main()
