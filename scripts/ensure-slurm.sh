#!/usr/bin/env bash
# Makes sure this machine can run the Slurm test cluster (tests/harness/slurm_cluster.py, on the namespace
# hosts of scripts/ensure-hosts.sh): Debian's slurmctld, slurmd and slurm-client (Slurm 22.05 on
# bookworm), and libpmix2 with libpmix-dev, whose unversioned libpmix.so Slurm's mpi/pmix plugin
# loads for `srun --mpi=pmix`. The test cluster uses auth/none, so munge (which the packages
# depend on) is installed but never started. Idempotent and silent when everything is there;
# installing needs root (apt-get). Without root the Slurm tests skip, so this script then only
# says so and succeeds.
set -euo pipefail
source "$(dirname "$0")/lib-apt.sh"

TOOLS=(/usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/slurmstepd /usr/bin/srun /usr/bin/sbatch
    /usr/bin/salloc /usr/bin/squeue /usr/bin/sinfo /usr/bin/scancel /usr/bin/scontrol)
PACKAGES=(slurmctld slurmd slurm-client libpmix2 libpmix-dev)

missing() {
    local tool
    for tool in "${TOOLS[@]}"; do
        [[ -x "$tool" ]] || return 0
    done
    # the unversioned library (a link that only libpmix-dev installs)
    compgen -G "/usr/lib/*/pmix2/lib/libpmix.so" >/dev/null || return 0
    return 1
}

# --missing: the Debian packages to install, if any (scripts/ensure-system.sh).
if [[ "${1:-}" == "--missing" ]]; then
    if missing; then echo "${PACKAGES[*]}"; fi
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    # The test cluster's hosts are network namespaces, which need root: the tests skip anyway.
    if missing; then
        explain_without_root ensure-slurm Slurm "the Slurm tests" "${PACKAGES[*]}"
    fi
    exit 0
fi

if missing; then
    echo "ensure-slurm: installing Debian's ${PACKAGES[*]} (for tests/hosts/test_slurm.py)..." >&2
    apt_install_without_daemons "${PACKAGES[@]}"
    if missing; then
        echo "ensure-slurm: apt-get installed ${PACKAGES[*]} but one of ${TOOLS[*]}" >&2
        echo "or /usr/lib/*/pmix2/lib/libpmix.so is missing" >&2
        exit 1
    fi
    echo "ensure-slurm: $(/usr/sbin/slurmd -V 2>&1 | head -n 1) installed" >&2
fi
