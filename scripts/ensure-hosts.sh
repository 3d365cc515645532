#!/usr/bin/env bash
# Makes sure this machine can build the multi-host test cluster (tests/harness/netns_hosts.py): Debian's
# openssh-server (sshd, with the ssh client and ssh-keygen), so that mpiexec's default ssh launch
# is what tests/hosts/test_hosts.py exercises, and a working `ip netns` (network namespaces, needs
# root). Idempotent and silent when everything is there; installing needs root (apt-get).
# Without root the multi-host tests skip, so this script then only says so and succeeds.
set -euo pipefail
source "$(dirname "$0")/lib-apt.sh"

SSHD=/usr/sbin/sshd
TOOLS=("$SSHD" /usr/bin/ssh /usr/bin/ssh-keygen)

missing() {
    local tool
    for tool in "${TOOLS[@]}"; do
        [[ -x "$tool" ]] || return 0
    done
    return 1
}

# --missing: the Debian packages to install, if any (scripts/ensure-system.sh).
if [[ "${1:-}" == "--missing" ]]; then
    if missing; then echo openssh-server openssh-client; fi
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    # Network namespaces need root, so the multi-host tests skip for this user anyway.
    if missing; then
        explain_without_root ensure-hosts openssh-server "the multi-host tests" openssh-server
    fi
    exit 0
fi

if missing; then
    echo "ensure-hosts: installing Debian's openssh-server (for tests/hosts/test_hosts.py)..." >&2
    apt_install_without_daemons openssh-server openssh-client
    if missing; then
        echo "ensure-hosts: apt-get installed openssh-server but one of ${TOOLS[*]} is missing" >&2
        exit 1
    fi
    echo "ensure-hosts: $("$SSHD" -V 2>&1 | head -n 1) installed" >&2
fi

# `ip netns` needs the kernel's network namespaces and a writable /run/netns.
PROBE="ipydt-probe-$$"
if ! ip netns add "$PROBE" 2>/dev/null; then
    echo "ensure-hosts: 'ip netns add' fails here (no network namespaces in this container?);" >&2
    echo "the multi-host tests (tests/hosts/test_hosts.py) will skip" >&2
    exit 0
fi
ip netns del "$PROBE"
