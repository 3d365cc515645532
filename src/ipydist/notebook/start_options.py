"""The options of ``%dist_start``, apart from the magic itself: there are many, and each
says what it does in ``%dist_start?`` and in the docs' table (docs/magics.md)."""

from __future__ import annotations

from IPython.core.magic_arguments import argument, magic_arguments

from ipydist.notebook.stall import STALL_WARNING_SECONDS
from ipydist.session import DEFAULT_START_TIMEOUT

#: In the order ``%dist_start?`` lists them.
START_OPTIONS = [
    argument(
        "--np", default=None, metavar="N",
        help="number of ranks (default: the kernel's --np, else one per GPU, else one per CPU "
        "core); more ranks than cores works: they share the cores",
    ),
    argument(
        "--gpus", default="auto", metavar="SPEC",
        help="auto: one GPU per rank, by local rank, when the host has GPUs; none: CPU only; "
        "a list such as 0,1: only these GPUs",
    ),
    argument(
        "--gpus-per-rank", default=1, metavar="N",
        help="GPUs each rank sees (default: 1): the host's GPUs are dealt out N to a rank, "
        "each rank numbering its own from cuda:0, for a model split across them",
    ),
    argument("--backend", default="auto", metavar="NAME",
             help="the torch.distributed backend (DDP's): auto (NCCL when ranks have GPUs, "
             "else gloo), nccl, gloo, or mpi (ipydist's, over mpi4py: CPU tensors, 2-20x "
             "faster than gloo on one host)"),
    argument("--transport", default="auto", metavar="NAME",
             help="the wire of ipydist's collectives on CPU tensors: auto (MPI, where mpiexec "
             "or srun started the ranks: 2-20x faster than gloo on one host; across hosts, "
             "hierarchical where ranks are dealt out by node), "
             "mpi (flat), hierarchical (forced), or gloo"),
    argument("--mpi", default=None, metavar="PATH",
             help="the mpiexec to use (default: $IPYDIST_MPIEXEC, the one next to this "
             "Python, then $PATH); on one host MPICH's starts the ranks with the "
             "mpiexec.gforker beside it, which listens on no port"),
    argument(
        "--hosts", default=None, metavar="SPEC",
        help="hosts to run on, with slots: nodeA:4,nodeB:4 (a host without :N has one slot; "
        "--np defaults to the slots)",
    ),
    argument(
        "--hostfile", default=None, metavar="FILE",
        help="hosts to run on, one per line: 'nodeA slots=4' (Open MPI) or 'nodeA:4' (MPICH); "
        "inside a Slurm allocation the default is its nodes",
    ),
    argument(
        "--launcher", default="mpiexec", metavar="NAME",
        help="mpiexec (default; over ssh across hosts) or slurm: srun in this Slurm "
        "allocation, or outside one salloc for a new allocation, then srun in it",
    ),
    argument("--partition", default=None, metavar="NAME",
             help="with --launcher slurm outside an allocation: the partition to ask for"),
    argument("--time", default=None, metavar="LIMIT",
             help="with --launcher slurm outside an allocation: the job's time limit, "
             "as Slurm writes it (30, 1:00:00, 1-0)"),
    argument("--account", default=None, metavar="NAME",
             help="with --launcher slurm outside an allocation: the account to charge"),
    argument(
        "--slurm-args", default="", metavar='"..."',
        help='with --launcher slurm: extra arguments for salloc (new allocation) or srun '
        '(inside one), e.g. --slurm-args="--nodes=2 --gres=gpu:4"',
    ),
    argument(
        "--mpi-args", default="", metavar='"..."',
        help='extra mpiexec arguments, written with = and quotes, e.g. '
        '--mpi-args="--hostfile hosts"',
    ),
    argument(
        "--timeout", type=float, default=DEFAULT_START_TIMEOUT, metavar="S",
        help="seconds to wait for every rank to start (default: %(default)g); a launch that "
        "fails sooner ends at once with MPI's own message",
    ),
    argument(
        "--env", nargs="+", action="extend", default=[], metavar="K=V",
        help="environment variables for every rank",
    ),
    argument(
        "--stall-warning", type=float, default=STALL_WARNING_SECONDS, metavar="S",
        help="warn under the cell when ranks have waited S seconds in a collective that other "
        "ranks have not called (default: %(default)g; 0: never)",
    ),
    argument(
        "--elastic", action="store_true", default=None,
        help="the ranks outlive one that dies, which is replaced with rank 0's variables "
        "(Open MPI's fault tolerance, ULFM; mpiexec only). Default: on across hosts; on one "
        "host it opens MPI's TCP port on every interface, so it is asked for",
    ),
    argument(
        "--no-elastic", dest="elastic", action="store_false",
        help="a rank that dies ends the job, as plain mpiexec does: %%dist_restart then",
    ),
    argument(
        "--min-np", default=None, metavar="M",
        help="elastic: when a dead rank's replacement cannot be started, go on with the "
        "others if they are at least M (default: as many as started, so never fewer)",
    ),
    argument(
        "--no-init", action="store_true",
        help="do not create the torch.distributed process group: your code calls "
        "init_process_group itself",
    ),
]


def start_options(magic):
    """``magic`` with :data:`START_OPTIONS` (as ``@magic_arguments()`` and one ``@argument``
    per option, in this order, would give it)."""
    for option in reversed(START_OPTIONS):
        magic = option(magic)
    return magic_arguments()(magic)
