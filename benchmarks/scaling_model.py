"""A scaling model of synchronous data-parallel training, calibrated on benchmarks/links.py, that
predicts the efficiency (compute time / step time) of fp32, 1-bit and BMUF at 8, 64 and 512 GPUs
on NCCL-class links. A model, not a measurement: docs/benchmarks.md states its assumptions.

A step is the compute ``C`` and the allreduce of the gradients, ``S`` bytes, the part of it not
hidden behind the backward pass (``1 - overlap``)::

    T = C + (1 - overlap) x [ 2 (G-1)/G x S / B_host          (within a host of G GPUs)
                              + 2 (H-1)/H x S / (K eta B_nic)  (across H hosts: the stripes
                                                                through the host's K NICs)
                              + 2 (H-1) alpha ]                 (a ring's steps across hosts)

with the hierarchical allreduce's traffic (ipydist's across hosts, NCCL's rings of nodes).
1-bit sends ``S / onebit_factor`` and costs ``onebit_cost`` seconds a parameter to quantize;
BMUF sends the model once a block of ``block`` steps and adds ``bmuf_cost`` a parameter a block.

Calibrated on the measurements of benchmarks/links.py (2 hosts x 2 CPU ranks, 1 Gbit/s):

- ``eta``: the fraction of a link's rate a large allreduce reaches: 64 MB across hosts in
  574 ms, where the least a host must send is the 64 MB once: 0.93 of 1 Gbit/s;
- ``overlap``: the fp32 step took 73.8 ms where the same step with no allreduce took 14.0 ms and
  the allreduce of its 6.4 MB alone would take 55 ms at that eta: nothing was hidden (0);
- ``onebit_factor``: 1-bit sends 21.3x fewer bytes than fp32 (benchmarks/compression.py's
  count, the same model).

    .venv/bin/python benchmarks/scaling_model.py [--overlap 0.5] [--eta 0.9]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

#: Calibrated on benchmarks/links.py (see the docstring) and benchmarks/compression.py.
ETA = 0.93
OVERLAP = 0.0
ONEBIT_FACTOR = 21.3

#: Hosts as assumed (docs/benchmarks.md): 8 GPUs a host on NVLink (an allreduce's bus
#: bandwidth about 360 GB/s, as NCCL's tests report on H100 boxes).
GPUS_PER_HOST = 8
B_HOST = 360e9


@dataclass(frozen=True)
class Network:
    name: str
    nics: int  # a host's NICs: the stripes cross through them side by side
    bits_per_second: float  # each NIC's
    alpha: float  # seconds a step of the ring across hosts


NETWORKS = [
    Network("NCCL-class: a 400 Gbit/s InfiniBand NIC a GPU", 8, 400e9, 10e-6),
    Network("Ethernet: one 25 Gbit/s NIC a host", 1, 25e9, 30e-6),
]


@dataclass(frozen=True)
class Workload:
    name: str
    params: float  # parameters
    compute: float  # seconds of forward and backward a step on one GPU
    #: seconds a parameter to quantize 1-bit on a GPU (error feedback, packing), and BMUF's
    #: block update a parameter a block: assumed, a few elementwise passes at GPU memory speed
    onebit_cost: float = 12 * 4 / 2e12
    bmuf_cost: float = 8 * 4 / 2e12


WORKLOADS = [
    Workload("ResNet-50 (25.6 M, 100 ms a step)", 25.6e6, 0.100),
    Workload("GPT-2 medium (355 M, 400 ms a step)", 355e6, 0.400),
]


def allreduce_seconds(nbytes: float, gpus: int, net: Network, eta: float) -> float:
    """The hierarchical allreduce of ``nbytes`` among ``gpus``: reduce-scatter and allgather
    within each host, and the host's stripes across the hosts through its NICs."""
    g = min(gpus, GPUS_PER_HOST)
    h = max(1, gpus // GPUS_PER_HOST)
    within = 2 * (g - 1) / g * nbytes / B_HOST if g > 1 else 0.0
    if h == 1:
        return within
    link = min(g, net.nics) * eta * net.bits_per_second / 8
    return within + 2 * (h - 1) / h * nbytes / link + 2 * (h - 1) * net.alpha


def step_seconds(w: Workload, variant: str, gpus: int, net: Network, eta: float,
                 overlap: float, block: int = 8) -> float:
    grads = w.params * 4
    if variant == "fp32":
        return w.compute + (1 - overlap) * allreduce_seconds(grads, gpus, net, eta)
    if variant == "1-bit":
        comm = allreduce_seconds(grads / ONEBIT_FACTOR, gpus, net, eta)
        return w.compute + w.params * w.onebit_cost + (1 - overlap) * comm
    comm = allreduce_seconds(grads, gpus, net, eta)  # bmuf: the model, once a block
    return w.compute + (comm + w.params * w.bmuf_cost) / block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eta", type=float, default=ETA)
    parser.add_argument("--overlap", type=float, default=OVERLAP)
    args = parser.parse_args(argv)
    print(f"efficiency = compute / step time; eta {args.eta}, overlap {args.overlap}, "
          f"{GPUS_PER_HOST} GPUs a host at {B_HOST / 1e9:.0f} GB/s; bmuf: blocks of 8 steps")
    for net in NETWORKS:
        print(f"\n{net.name}, {net.alpha * 1e6:g} us a step across hosts")
        print(f"{'workload':<38}{'GPUs':>6}{'fp32':>8}{'1-bit':>8}{'bmuf':>8}")
        for w in WORKLOADS:
            for gpus in (8, 64, 512):
                eff = [w.compute / step_seconds(w, v, gpus, net, args.eta, args.overlap)
                       for v in ("fp32", "1-bit", "bmuf")]
                print(f"{w.name:<38}{gpus:>6}" + "".join(f"{e:>8.1%}" for e in eff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
