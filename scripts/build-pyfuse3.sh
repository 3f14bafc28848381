#!/bin/sh
# Install pyfuse3 with memfs's patches into a virtualenv.
#
#   scripts/build-pyfuse3.sh VENV
#
# pyfuse3 (3.5.0) gives a filesystem no say in the FUSE connection's
# parameters; scripts/pyfuse3/0001-init-connection.patch adds
# Operations.init_connection(conn).  0002-receive-before-waiting.patch takes
# requests the kernel has already queued without a pass of the event loop
# each.  0003-extra-init-flags.patch lets a filesystem ask for INIT flags
# that libfuse 3.14 cannot (FUSE_HANDLE_KILLPRIV_V2).  0004-fallocate.patch
# forwards fallocate(2) to Operations.fallocate().  0005-locks.patch forwards
# lock requests (getlk, setlk, flock) to a filesystem that asks for them, with
# interruptible waits.  0006-reply-threads.patch writes READ replies from
# threads of their own while the request loop goes on.  0007-passthrough.patch
# lets open and create hand a file to the kernel's FUSE passthrough (reads and
# writes go to a backing file, not the daemon).  0008-lseek.patch forwards
# lseek(2)'s SEEK_DATA and SEEK_HOLE to Operations.lseek().  The patches' headers
# say why and what they measured.  The source distribution comes from PyPI,
# pinned by version and sha256; the build is pip's usual one (Cython,
# libfuse3-dev).  The installed version is
# 3.5.0+memfs.15, so a rerun with the patches in place does nothing, and memfs
# still runs on a plain pyfuse3 (it logs that the kernel keeps its defaults).
set -eu
VENV=${1:?usage: $0 VENV}
VERSION=3.5.0
LOCAL=memfs.15
SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
HERE=$(cd "$(dirname "$0")" && pwd)

installed=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("pyfuse3"))' 2>/dev/null || true)
if [ "$installed" = "$VERSION+$LOCAL" ]; then
    exit 0
fi
work=$(mktemp -d /tmp/memfs-pyfuse3.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$VENV/bin/pip" download -q --no-binary :all: --no-deps -d "$work" "pyfuse3==$VERSION"
sdist="$work/pyfuse3-$VERSION.tar.gz"
echo "$SHA256  $sdist" | sha256sum -c --quiet - || {
    echo "memfs setup: $sdist does not have the pinned sha256; not building it" >&2
    exit 1
}
tar -xzf "$sdist" -C "$work"
src="$work/pyfuse3-$VERSION"
for p in "$HERE"/pyfuse3/0*.patch; do
    patch -s -p1 -d "$src" < "$p"
done
rm -f "$src/src/pyfuse3/__init__.c"  # generated from the patched .pyx by the build
sed -i "s/^Version: $VERSION\$/Version: $VERSION+$LOCAL/" "$src/PKG-INFO"
"$VENV/bin/pip" install -q "$src"
echo "memfs setup: pyfuse3 $VERSION+$LOCAL (with memfs's patches) installed in $VENV"
