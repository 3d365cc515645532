"""Several ranks on one GPU: what the machine's NCCL allows, and what each way costs.

Two to four processes all on ``cuda:0`` (torch.distributed, no ipydist), each way in turn:

- ``nccl-plain``: NCCL as it is (before 2.30 it refuses: "Duplicate GPU detected");
- ``nccl-multi-rank``: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL 2.30's shared mode);
- ``nccl-hostid``: each rank its own ``NCCL_HOSTID``, so NCCL takes it for another host and
  talks over its socket transport;
- ``gloo-cuda``: gloo with CUDA tensors (through host memory), and which of its collectives
  take them.

Prints one line a way: the median 4 KB allreduce, the median 64 MB allreduce and its bus
bandwidth, or why it failed. One GPU is enough; without one it says so and ends.

    python benchmarks/shared_gpu.py [--np 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

RANK = r'''
import json, os, statistics, time, torch, torch.distributed as dist
rank, n, backend = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["BACKEND"]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)

def median_seconds(numel, reps):
    t = torch.ones(numel, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    took = []
    for _ in range(reps):
        start = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - start)
    return statistics.median(took)

small, big = median_seconds(1024, 50), median_seconds(16 * 2**20, 10)
check = torch.full((4,), float(rank), device=dev)
dist.all_reduce(check)
out = {"sum_right": check[0].item() == sum(range(n)), "4KB_ms": round(small * 1e3, 3),
       "64MB_ms": round(big * 1e3, 2), "busbw_GBs": round(2 * (n - 1) / n * 64e6 / big / 1e9, 2)}
if backend == "gloo":
    ones = lambda: torch.ones(4, device=dev)
    for name, call in [
            ("broadcast", lambda: dist.broadcast(ones(), 0)),
            ("allgather", lambda: dist.all_gather([ones() for _ in range(n)], ones())),
            ("reduce_scatter", lambda: dist.reduce_scatter(ones(), [ones() for _ in range(n)])),
            ("all_to_all", lambda: dist.all_to_all([ones() for _ in range(n)],
                                                   [ones() for _ in range(n)]))]:
        try:
            call()
            out[name] = "ok"
        except Exception as e:
            out[name] = str(e)[:60]
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''

WAYS = {
    "nccl-plain": ("nccl", {}),
    "nccl-multi-rank": ("nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}),
    "nccl-hostid": ("nccl", {"NCCL_HOSTID": "ipydist-shared-gpu-{rank}"}),
    "gloo-cuda": ("gloo", {}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_way(way: str, n: int, limit: float = 30.0) -> dict:
    """Start ``n`` ranks on cuda:0 the ``way`` named; rank 0's figures, or why it failed."""
    backend, extra = WAYS[way]
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), BACKEND=backend, NCCL_DEBUG="WARN",
                   NCCL_SOCKET_IFNAME="lo")
        env.update({k: v.format(rank=r) for k, v in extra.items()})
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + limit
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + f"\n(no answer in {limit:.0f} s)")
    found = [ln[len("RESULT "):] for ln in outputs[0].splitlines() if ln.startswith("RESULT ")]
    if found:
        return json.loads(found[0])
    why = [ln.strip() for out in outputs for ln in out.splitlines()
           if "NCCL WARN" in ln or "Error" in ln or "no answer" in ln]
    return {"failed": why[0] if why else outputs[0][-300:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to measure")
        return 0
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}; every rank on cuda:0")
    for n in args.np:
        for way in WAYS:
            print(json.dumps({"np": n, "way": way, **run_way(way, n)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
