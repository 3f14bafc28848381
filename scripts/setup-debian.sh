#!/bin/sh
# Install the Debian packages memfs needs (idempotent; needs root).
# fuse3: fusermount3 and the kernel-side helpers; libfuse3-dev + pkg-config: to
# build pyfuse3; fio: benchmarks and data-verification tests; iproute2: network
# namespaces in multi-host tests.
set -eu
PKGS="fuse3 libfuse3-dev pkg-config fio iproute2 python3-venv"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "memfs setup: need root to install:$missing" >&2
    exit 1
fi
echo "memfs setup: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq $missing >/dev/null
