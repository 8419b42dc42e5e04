#!/usr/bin/env bash
# Installs the real servers the cluster tests run (etcd 3.4, nats-server 2.9) from Debian.
# Idempotent: does nothing when both are already installed. Needs root (CI runs as root).
set -euo pipefail
if [ -x /usr/bin/etcd ] && command -v nats-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "install_services.sh: not root; install etcd-server etcd-client nats-server yourself" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq etcd-server etcd-client nats-server >/dev/null
# The packages may start a system service; the tests run their own servers on free ports.
for svc in etcd nats-server; do
  if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl stop "$svc" >/dev/null 2>&1 || true; fi
done
