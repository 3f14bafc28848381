#!/bin/sh
# Install the Debian packages memfs needs (idempotent; needs root).
# fuse3: fusermount3 and the kernel-side helpers; libfuse3-dev + pkg-config +
# patch: to build pyfuse3 with memfs's patch (scripts/build-pyfuse3.sh); fio:
# benchmarks and data-verification tests; iproute2: network namespaces in
# multi-host tests; attr: setfattr/getfattr, which README's examples use.
# Optional: python3-pyverbs (rdma-core's userspace verbs and their Python
# bindings) for the verbs (RDMA) transport.  memfs installs and runs without it;
# MEMFS_NO_RDMA=1 does not install it, and a failure to install it is only a note.
set -eu
PKGS="fuse3 libfuse3-dev pkg-config patch fio iproute2 python3-venv attr"
OPTIONAL="python3-pyverbs"
installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}
missing=""
for p in $PKGS; do
    installed "$p" || missing="$missing $p"
done
optional=""
if [ -z "${MEMFS_NO_RDMA:-}" ]; then
    for p in $OPTIONAL; do
        installed "$p" || optional="$optional $p"
    done
fi
[ -z "$missing$optional" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    if [ -n "$missing" ]; then
        echo "memfs setup: need root to install:$missing" >&2
        exit 1
    fi
    echo "memfs setup: not root, not installing optional$optional (no RDMA transport)"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
if [ -n "$missing" ]; then
    echo "memfs setup: installing$missing"
    apt-get install -y -qq $missing >/dev/null
fi
if [ -n "$optional" ]; then
    echo "memfs setup: installing optional$optional (RDMA transport)"
    apt-get install -y -qq $optional >/dev/null ||
        echo "memfs setup: could not install$optional: no verbs (RDMA) transport" >&2
fi
