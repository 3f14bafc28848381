#!/bin/sh
# Make Debian's pyverbs (package python3-pyverbs, from rdma-core) importable from
# the virtual environment VENV, for the verbs (RDMA) transport: a .pth file in
# the venv's site-packages names a directory that holds nothing but a symlink to
# /usr/lib/python3/dist-packages/pyverbs (the rest of dist-packages stays out).
# Optional: without python3-pyverbs memfs installs and runs, minus RDMA.
# Idempotent; undoes itself when pyverbs is gone or does not import.
set -eu
VENV=${1:-.venv}
SRC=/usr/lib/python3/dist-packages/pyverbs
PY="$VENV/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LINKDIR=$(cd "$VENV" && pwd)/system-pyverbs
PTH="$SITE/memfs-system-pyverbs.pth"
if [ ! -d "$SRC" ]; then
    rm -f "$PTH"
    rm -rf "$LINKDIR"
    echo "memfs setup: python3-pyverbs is not installed: no verbs (RDMA) transport"
    exit 0
fi
mkdir -p "$LINKDIR"
ln -sfn "$SRC" "$LINKDIR/pyverbs"
echo "$LINKDIR" > "$PTH"
if "$PY" -c 'import pyverbs.device' 2>/dev/null; then
    echo "memfs setup: Debian's pyverbs linked into $VENV ($LINKDIR)"
else
    rm -f "$PTH"
    echo "memfs setup: Debian's pyverbs does not import in $("$PY" -V 2>&1) of $VENV:" \
         "no verbs (RDMA) transport" >&2
fi
