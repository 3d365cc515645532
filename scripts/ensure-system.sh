#!/usr/bin/env bash
# Installs every Debian package `make test` needs with one apt-get (one index update, one
# resolution, one download), where each ensure-*.sh would run its own: Node.js to build the
# JupyterLab panel, Chromium for the browser tests, openssh-server for the namespace hosts, Slurm
# and PMIx for the Slurm tests. Then each script checks its own part as before, and says what is
# wrong or, without root, what to run. `make test` runs this beside pip's install of the venv.
set -euo pipefail
here="$(dirname "$0")"
source "$here/lib-apt.sh"

SCRIPTS=(ensure-node.sh ensure-chromium.sh ensure-hosts.sh ensure-slurm.sh)

if [[ "$(id -u)" -eq 0 ]]; then
    packages=()
    for script in "${SCRIPTS[@]}"; do
        read -r -a more <<<"$("$here/$script" --missing)"
        packages+=(${more[@]+"${more[@]}"})
    done
    if ((${#packages[@]})); then
        echo "ensure-system: installing Debian's ${packages[*]} with one apt-get..." >&2
        apt_install_without_daemons "${packages[@]}"
    fi
fi
for script in "${SCRIPTS[@]}"; do
    "$here/$script"
done
