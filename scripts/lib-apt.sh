# Shared by the ensure-*.sh scripts, which `source` it: installing Debian packages for the tests
# without starting the daemons they ship (the tests start their own, inside namespace hosts).

# apt_install_without_daemons PACKAGE... — apt-get install as root, quietly, with a policy-rc.d
# that answers 101 so that no package starts or enables a system sshd, munged, slurmctld or slurmd.
apt_install_without_daemons() {
    apt-get update -qq
    local policy=/usr/sbin/policy-rc.d
    local own_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        own_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes \
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null || rc=$?
    if [[ "$own_policy" -eq 1 ]]; then
        rm -f "$policy"
    fi
    return "$rc"
}

# explain_without_root NAME WHAT TESTS PACKAGE... — for a user who is not root: the tests that
# need these packages also need network namespaces (root), so they skip; say how to run them.
explain_without_root() {
    local name=$1 what=$2 tests=$3
    shift 3
    echo "$name: $what is missing and $tests need root (network namespaces); they" >&2
    echo "will skip. To run them, as root:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends $*" >&2
    echo "  sudo scripts/$name.sh" >&2
}
