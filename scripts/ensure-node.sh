#!/usr/bin/env bash
# Makes sure Node.js 18 or later and npm are there: JupyterLab's extension builder
# (npm's @jupyterlab/builder) builds ipydist's side panel (labextension/) with them, when the
# package is built (`make test`, `make lab`, `make wheel`); nobody who installs the wheel needs
# them. Installs Debian's nodejs and npm when node is missing; idempotent and silent otherwise.
set -euo pipefail
source "$(dirname "$0")/lib-apt.sh"

node_ok() {
    command -v node >/dev/null && command -v npm >/dev/null &&
        [[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 18 ]]
}

# --missing: the Debian packages to install, if any (scripts/ensure-system.sh).
if [[ "${1:-}" == "--missing" ]]; then
    node_ok || echo nodejs npm
    exit 0
fi
if node_ok; then
    exit 0
fi
if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure-node: Node.js >= 18 and npm are needed to build the JupyterLab panel. Run:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends nodejs npm" >&2
    exit 1
fi
echo "ensure-node: installing Debian's nodejs and npm (to build the JupyterLab panel)..." >&2
apt_install_without_daemons nodejs npm
if ! node_ok; then
    echo "ensure-node: Debian's nodejs is older than 18 ($(node --version 2>/dev/null)):" >&2
    echo "the JupyterLab panel cannot be built here" >&2
    exit 1
fi
echo "ensure-node: node $(node --version) installed" >&2
