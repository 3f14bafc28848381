"""memfs.array against real mounts: direct access as root, the mount for everyone else.

Every file the API writes is compared byte for byte with what ``numpy.save``
writes, and read back through the mount with ``numpy.load``; every file numpy
writes through the mount is read back with the API.  Other processes (slab
writers, readers racing a replace, a user who may not reach the pool) are
real processes; the cluster test runs on network-namespace hosts.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import memfs.array as ma
from memfs.cli.mounts import is_mounted
from tests.conftest import MOUNT_SKIP, Mounted, wait_gone

pytestmark = [pytest.mark.mount, pytest.mark.skipif(MOUNT_SKIP is not None, reason=str(MOUNT_SKIP))]

NOBODY = 65534
REPO = str(Path(__file__).resolve().parents[2])


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def run_py(code: str, *args: str, prefix: tuple[str, ...] = (), timeout: float = 120,
           ) -> subprocess.CompletedProcess[str]:
    """Run *code* in a new Python process (as *prefix* says: another user, another host)."""
    res = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return res


def samples() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "f8_2d": rng.random((300, 517)),
        "f4_fortran": np.asfortranarray(rng.random((123, 45)).astype("f4")),
        "zero_d": np.array(42, dtype="i8"),
        "empty": np.zeros((0, 5), dtype="f8"),
        "one_byte": np.array([7], dtype="u1"),
        "complex": (rng.random(1001) + 1j * rng.random(1001)).astype("c16"),
        "structured": np.array([(1.5, 2, b"abc"), (-3.0, 4, b"xyzzy")] * 500,
                               dtype=[("x", "<f4"), ("n", "<i8"), ("s", "S5")]),
        "bool": rng.random(777) > 0.5,
        "big_endian": np.arange(10_000, dtype=">i4"),
        "unicode": np.array(["memfs", "array", "ü"] * 10, dtype="U7"),
        "datetime": np.arange("2026-01-01", "2026-03-01", dtype="datetime64[D]"),
        "f2_3d": rng.random((17, 19, 23)).astype("f2"),
        "chunk_plus_3": np.frombuffer(rng.bytes((64 << 10) + 3), dtype="u1"),
        "several_pieces": np.arange(20 << 20, dtype="i4"),  # 80 MiB: more than one transfer
        "non_contiguous": rng.random((200, 300))[::2, ::3],
    }


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_round_trips_through_the_mount(mnt: Mounted) -> None:
    """API -> numpy.load through the mount, numpy.save -> API: many dtypes and shapes;
    the API's files are exactly what numpy.save writes."""
    for name, arr in samples().items():
        p = mnt / f"{name}.npy"
        ma.save(p, arr)
        assert p.read_bytes() == npy_bytes(arr), name
        assert same(np.load(p), arr), name
        with ma.open(p) as af:
            assert af.direct, "root gets the pool itself"
            assert af.shape == arr.shape and af.dtype == arr.dtype
        q = mnt / f"np-{name}.npy"
        np.save(q, arr)
        back = ma.load(q)
        assert same(back, arr), name
        assert back.flags.c_contiguous == np.load(q).flags.c_contiguous, name  # its order
    assert not [n for n in os.listdir(mnt.path) if "memfs-array" in n], "temporary files left"


def test_load_into_out(mnt: Mounted) -> None:
    arr = np.random.default_rng(1).random((64, 1000))
    p = mnt / "a.npy"
    ma.save(p, arr)
    out = np.empty_like(arr)
    assert ma.load(p, out=out) is out and same(out, arr)
    with pytest.raises(ValueError, match="out= is"):
        ma.load(p, out=np.empty((64, 999)))
    with pytest.raises(ValueError, match="C order"):
        ma.load(p, out=np.empty((64, 1000), order="F"))
    with ma.open(p) as af:
        part = np.empty((10, 1000))
        assert af.read(5, 15, out=part) is part and same(part, arr[5:15])


def test_several_gib(memfs_mount: Callable[..., Mounted]) -> None:
    """A 3 GiB array: transfers in pieces, extents past 2 GiB (one syscall's limit)."""
    m = memfs_mount("--size", "3600M")
    n = (3 << 30) // 8
    arr = np.arange(n, dtype=np.int64)
    p = m / "big.npy"
    ma.save(p, arr)
    header = len(npy_bytes(np.empty(n, dtype=np.int64)[:0]))
    assert p.stat().st_size == (3 << 30) + header
    with open(p, "rb") as f:  # spot checks through the mount
        for i in (0, n // 3, n - 1):
            f.seek(header + 8 * i)
            assert int.from_bytes(f.read(8), "little") == i
    del arr
    back = ma.load(p)
    assert back.shape == (n,) and back[0] == 0 and back[-1] == n - 1
    assert np.array_equal(back[:: 1 << 20], np.arange(0, n, 1 << 20))
    assert bool((np.diff(back) == 1).all())


WRITE_SLAB = """
import sys, numpy as np, memfs.array as ma
path, k, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with ma.open(path, "r+") as af:
    assert af.direct
    block = np.full((rows, af.shape[1]), k, dtype=af.dtype) + np.arange(af.shape[1])
    for i in range(0, rows, 7):  # several slab writes each, of odd sizes
        af[k * rows + i : k * rows + min(i + 7, rows)] = block[i : i + 7]
"""


def test_slabs_from_four_processes(mnt: Mounted) -> None:
    rows, cols = 250, 2000
    p = mnt / "slabs.npy"
    with ma.open(p, "w", shape=(4 * rows, cols), dtype="f8") as af:
        assert af.direct and len(af) == 4 * rows
    assert same(np.load(p), np.zeros((4 * rows, cols)))
    before = p.stat().st_mtime_ns
    procs = [subprocess.Popen([sys.executable, "-c", WRITE_SLAB, str(p), str(k), str(rows)],
                              cwd=REPO, stderr=subprocess.PIPE, text=True) for k in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    expect = np.repeat(np.arange(4.0), rows)[:, None] + np.arange(cols)
    assert same(ma.load(p), expect)
    assert same(np.load(p), expect), "the mount sees every slab at once"
    assert p.stat().st_mtime_ns > before
    with ma.open(p) as af:
        for k in range(4):
            assert same(af[k * rows : (k + 1) * rows], expect[k * rows : (k + 1) * rows])
        assert same(af[-1], expect[-1]) and same(af[...], expect)


READ_LOOP = """
import sys, time, numpy as np, memfs.array as ma
path, how, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
seen = set()
while time.time() < until:
    a = ma.load(path) if how == "api" else np.load(path)
    v = np.unique(a)
    assert len(v) == 1, f"a mix of {v[:10]}"
    seen.add(int(v[0]))
print(len(seen))
"""


def test_replace_while_others_read(mnt: Mounted) -> None:
    """Readers through the API and through the mount see the old array or the new one,
    never a mix, while another process replaces it again and again."""
    p = mnt / "live.npy"
    n = (24 << 20) // 8
    ma.save(p, np.zeros(n))
    until = time.time() + 6
    readers = [subprocess.Popen([sys.executable, "-c", READ_LOOP, str(p), how, str(until)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for how in ("api", "mount")]
    k = 0
    while time.time() < until - 0.5:
        k += 1
        ma.save(p, np.full(n, float(k)))
    for r in readers:
        out, err = r.communicate(timeout=60)
        assert r.returncode == 0, err
        assert int(out) > 1, "the reader saw some of the replacements"
    assert same(np.load(p), np.full(n, float(k)))


def test_enospc_leaves_nothing_behind(memfs_mount: Callable[..., Mounted]) -> None:
    m = memfs_mount("--size", "64M")
    keep = np.arange(3 << 20, dtype="i8")  # 24 MiB
    ma.save(m / "keep.npy", keep)
    free = os.statvfs(m.path).f_bavail
    for attempt in (lambda: ma.save(m / "keep.npy", np.ones(6 << 20)),   # 48 MiB more
                    lambda: ma.save(m / "new.npy", np.ones(6 << 20)),
                    lambda: ma.open(m / "w.npy", "w", shape=(6 << 20,), dtype="f8")):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.ENOSPC and str(m.path) in str(info.value)
        assert sorted(os.listdir(m.path)) == ["keep.npy"]
        assert same(ma.load(m / "keep.npy"), keep) and same(np.load(m / "keep.npy"), keep)
        deadline = time.monotonic() + 10  # freed space is zeroed in the background
        while os.statvfs(m.path).f_bavail != free and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.statvfs(m.path).f_bavail == free


def test_the_mount_sees_direct_writes_at_once(mnt: Mounted) -> None:
    """The embedded mount lets the kernel cache names, attributes and pages for a day:
    a direct save or slab write must drop them."""
    p = mnt / "c.npy"
    a = np.arange(1000.0)
    ma.save(p, a)
    assert same(np.load(p), a)
    st = p.stat()
    b = np.arange(3000.0) * 2  # another size, another inode
    ma.save(p, b)
    assert same(np.load(p), b) and p.stat().st_size != st.st_size
    q = mnt / "absent.npy"
    assert not q.exists()  # a negative entry the kernel keeps
    ma.save(q, a)
    assert q.exists() and same(np.load(q), a)
    with open(p, "rb") as f:
        f.read()  # pages cached
        with ma.open(p, "r+") as af:
            mtime = p.stat().st_mtime_ns
            time.sleep(0.01)
            af[10:20] = -1.0
        f.seek(0)
        got = np.load(f)
    b[10:20] = -1.0
    assert same(got, b) and p.stat().st_mtime_ns > mtime


NON_OWNER = """
import os, sys, numpy as np, memfs.array as ma
d = sys.argv[1]
a = np.arange(50_000, dtype="f8").reshape(500, 100)
ma.save(d + "/mine.npy", a)
assert np.array_equal(np.load(d + "/mine.npy"), a)
assert np.array_equal(ma.load(d + "/mine.npy"), a)
with ma.open(d + "/rows.npy", "w", shape=(10, 100), dtype="f8") as af:
    print("direct", af.direct)
with ma.open(d + "/rows.npy", "r+") as af:
    af[3:5] = 7.0
    print("direct", af.direct)
assert np.load(d + "/rows.npy")[3:5].sum() == 1400.0
try:
    ma.load(d + "/secret.npy")
except PermissionError as exc:
    print("refused", exc.errno)
print(sorted(n for n in os.listdir(d) if "memfs-array" in n))
try:
    ma.save(sys.argv[2] + "/x.npy", a)  # a directory this user may not write in
except PermissionError as exc:
    print("save refused", exc.filename == sys.argv[2] + "/x.npy")
"""


def test_other_users_go_through_the_mount() -> None:
    """A user who is not root nor the mount's owner gets no pool access: the API works
    through the mount for them, with their permissions."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing (util-linux)")
    base = Path(tempfile.mkdtemp(prefix="memfs-array-", dir="/tmp"))
    base.chmod(0o755)
    mnt = base / "mnt"
    mnt.mkdir()
    log = base / "mount.log"
    subprocess.run([sys.executable, "-m", "memfs", "mount", str(mnt), "--size", "64M",
                    "--log", str(log)], check=True, cwd=REPO, timeout=60)
    from memfs.cli.runtime import pid_file

    pid = int(pid_file(str(mnt)).read_text())
    try:
        shared = mnt / "shared"
        shared.mkdir(mode=0o777)
        shared.chmod(0o777)
        ma.save(shared / "secret.npy", np.ones(3))
        (shared / "secret.npy").chmod(0o600)
        closed = mnt / "closed"
        closed.mkdir(mode=0o755)
        res = run_py(NON_OWNER, str(shared), str(closed),
                     prefix=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"))
        assert res.stdout.split("\n")[:5] == ["direct False", "direct False",
                                              f"refused {errno.EACCES}", "[]",
                                              "save refused True"], res.stdout
        assert (shared / "mine.npy").stat().st_uid == NOBODY
        assert same(ma.load(shared / "mine.npy"), np.arange(50_000.0).reshape(500, 100))
        assert "refused a connection from uid 65534" in log.read_text()
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        assert wait_gone(pid, 30)
        assert not is_mounted(str(mnt))
        text = log.read_text()
        shutil.rmtree(base)
    assert "Traceback" not in text and " ERROR " not in text, text


def test_umount_under_an_open_array_file(mnt: Mounted) -> None:
    p = mnt / "u.npy"
    with ma.open(p, "w", shape=(100, 10), dtype="i4"):
        pass
    af = ma.open(p, "r+")
    assert af.direct
    af[0:2] = 1
    res = subprocess.run([sys.executable, "-m", "memfs", "umount", str(mnt.path)],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert wait_gone(mnt.pid, 30)
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        af[2:4] = 2
    assert str(p) in str(info.value)
    with pytest.raises(OSError):
        af[0:2]  # noqa: B018 - a read
    af.close()
    assert time.monotonic() - started < 10, "an error, not a hang"
    with pytest.raises(FileNotFoundError):
        ma.load(p)  # the directory under the mountpoint


CLUSTER_SAVE = """
import sys, numpy as np, memfs.array as ma
d = sys.argv[1]
a = np.arange(3_000_000, dtype="f8").reshape(3000, 1000)
ma.save(d + "/c.npy", a)
with ma.open(d + "/s.npy", "w", shape=(400, 1000), dtype="f8") as af:
    print("direct", af.direct)
"""
CLUSTER_LOAD = """
import sys, numpy as np, memfs.array as ma
d = sys.argv[1]
a = np.arange(3_000_000, dtype="f8").reshape(3000, 1000)
assert np.array_equal(ma.load(d + "/c.npy"), a)
assert np.array_equal(np.load(d + "/c.npy"), a)
with ma.open(d + "/s.npy", "r+") as af:
    print("direct", af.direct)
    af[100:200] = 5.0
"""


def test_cluster_save_on_one_node_load_on_another(tmp_path: Path) -> None:
    """Cluster mounts on network-namespace hosts: the API on each node reaches the memory
    servers itself; what one node saves or writes the other loads, through the API and
    through its mount."""
    from tests.mount.test_cluster import make_cluster
    from tests.netns import netns_unavailable

    if (why := netns_unavailable()) is not None:
        pytest.skip(why)
    with make_cluster(tmp_path, []) as c:
        c1, c2 = str(c.mnt["c1"]), str(c.mnt["c2"])
        res = run_py(CLUSTER_SAVE, c1, prefix=tuple(c.net.cmd("c1", [])))
        assert res.stdout.split("\n")[0] == "direct True", res.stdout
        res = run_py(CLUSTER_LOAD, c2, prefix=tuple(c.net.cmd("c2", [])))
        assert res.stdout.split("\n")[0] == "direct True", res.stdout
        expect = np.zeros((400, 1000))
        expect[100:200] = 5.0
        check = ("import sys, numpy as np, memfs.array as ma; d = sys.argv[1]; "
                 "print(np.load(d + '/s.npy').sum(), ma.load(d + '/s.npy').sum())")
        res = run_py(check, c1, prefix=tuple(c.net.cmd("c1", [])))
        assert res.stdout.split() == [str(expect.sum())] * 2, res.stdout


RACE_WRITER = """
import collections, json, sys, time, numpy as np, memfs.array as ma
path, seconds, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) << 17  # MiB of float64
errors = collections.Counter()
slabs = 0
with ma.open(path, "w", shape=(4 * n,), dtype="f8") as af:
    print("direct", af.direct, flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            af[(slabs % 4) * n:(slabs % 4 + 1) * n] = float(slabs)
        except OSError as e:
            errors[f"{e.errno} {e.strerror}"] += 1
        slabs += 1
print(json.dumps({"slabs": slabs, "errors": errors}), flush=True)
"""

RACE_OTHERS = """
import collections, json, os, sys, time
path, mode, seconds, pause = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
errors = collections.Counter()
ops = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        if mode == "stat":
            os.stat(path)
        else:
            os.truncate(path, 4096)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors[f"{e.errno} {e.strerror}"] += 1
    ops += 1
    time.sleep(pause)
print(json.dumps({"ops": ops, "errors": errors}), flush=True)
"""

BYSTANDER = """
import json, os, sys, time
d, seconds = sys.argv[1], float(sys.argv[2])
os.makedirs(d, exist_ok=True)
keep, made, bad = [], 0, []
end = time.monotonic() + seconds
while time.monotonic() < end:
    name = os.path.join(d, str(made))
    with open(name, "wb") as f:
        f.write(bytes([made % 251 + 1]) * (1 << 20))
    keep.append(made)
    made += 1
    if len(keep) > 24:  # their chunks go back to the pool, to be reused
        os.unlink(os.path.join(d, str(keep.pop(0))))
time.sleep(0.5)  # writes still on their way from the other node
for k in keep:
    with open(os.path.join(d, str(k)), "rb") as f:
        if f.read() != bytes([k % 251 + 1]) * (1 << 20):
            bad.append(k)
print(json.dumps({"made": made, "bad": bad}), flush=True)
"""


def start_py(code: str, prefix: tuple[str, ...], *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(code),
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def test_cluster_array_writes_racing_truncates_and_stats(tmp_path: Path) -> None:
    """An array process writing slab after slab while its own node truncates the file
    and the other node truncates and stats it: the writer's slabs fail only as cut by
    a truncate (never "the chunk map keeps changing"), the truncates and stats do not
    fail, and the other node's files, made in the space the truncates free, keep their
    own bytes."""
    import json

    from tests.mount.test_cluster import make_cluster
    from tests.netns import netns_unavailable

    if (why := netns_unavailable()) is not None:
        pytest.skip(why)
    seconds = 6.0
    with make_cluster(tmp_path, []) as c:
        c1, c2 = c.mnt["c1"], c.mnt["c2"]
        on1, on2 = tuple(c.net.cmd("c1", [])), tuple(c.net.cmd("c2", []))
        start = start_py

        path = c1 / "a.npy"
        procs = {
            "writer": start(RACE_WRITER, on1, path, seconds, 8),
            "truncates here": start(RACE_OTHERS, on1, path, "truncate", seconds, 0.05),
            "truncates there": start(RACE_OTHERS, on2, c2 / "a.npy", "truncate", seconds, 0.2),
            "stats there": start(RACE_OTHERS, on2, c2 / "a.npy", "stat", seconds, 0.001),
            "bystander": start(BYSTANDER, on2, c2 / "others", seconds),
        }
        out, said = {}, {}
        for name, p in procs.items():
            said[name], stderr = p.communicate(timeout=120)
            assert p.returncode == 0, f"{name}: {stderr}"
            out[name] = json.loads(said[name].splitlines()[-1])
        assert said["writer"].startswith("direct True"), said["writer"]
        cut = f"{errno.EIO} the file changed under the write"
        writer = out["writer"]
        assert writer["slabs"] > 4, out
        assert all(e.startswith(cut) for e in writer["errors"]), out
        for name in ("truncates here", "truncates there", "stats there"):
            assert not out[name]["errors"], out
        assert out["bystander"]["made"] > 24 and not out["bystander"]["bad"], out
        for node in ("c1", "c2"):
            log = (tmp_path / f"{node}.log").read_text()
            assert "not answering the recall" not in log, node


def test_cluster_truncate_under_a_stopped_array_writer(tmp_path: Path) -> None:
    """A truncate on the node of an array process stopped in the middle of a piece (its
    bytes not all moved) waits for it as a recall would, then fails with ETXTBSY and
    frees nothing: had it freed the chunks, files made meanwhile on the other node
    (in that space) would get the stopped writer's bytes once it runs again."""
    import random
    import signal

    from tests.mount.test_cluster import make_cluster
    from tests.netns import netns_unavailable

    if (why := netns_unavailable()) is not None:
        pytest.skip(why)
    rng = random.Random(5)
    with make_cluster(tmp_path, [], volume_size="256M") as c:
        c1, c2 = c.mnt["c1"], c.mnt["c2"]
        on1 = tuple(c.net.cmd("c1", []))
        path = c1 / "a.npy"
        writer = start_py(RACE_WRITER, on1, path, 120, 64)  # one 64 MiB piece per slab
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().startswith("direct True")
            refused: list[float] = []
            tries = 0
            while len(refused) < 2 and tries < 30:
                tries += 1
                time.sleep(rng.uniform(0.05, 0.3))
                os.kill(writer.pid, signal.SIGSTOP)
                try:
                    began = time.monotonic()
                    try:
                        subprocess.run([*on1, "truncate", "-s", "0", str(path)], check=True,
                                       capture_output=True, text=True, timeout=30)
                    except subprocess.CalledProcessError as e:
                        assert "Text file busy" in e.stderr, e.stderr
                        refused.append(time.monotonic() - began)
                    # Files made in the space a truncate frees, while the writer is stopped.
                    others = c2 / "others"
                    others.mkdir(exist_ok=True)
                    for k in range(8):
                        (others / str(k)).write_bytes(bytes([k + 1]) * (16 << 20))
                finally:
                    os.kill(writer.pid, signal.SIGCONT)
                time.sleep(0.3)  # the writer's late bytes, if it had any to land
                for k in range(8):
                    assert (others / str(k)).read_bytes() == bytes([k + 1]) * (16 << 20), (
                        f"file {k} got bytes it was not written (try {tries})")
                shutil.rmtree(others)
            assert len(refused) == 2, f"no truncate met a stopped transfer in {tries} tries"
            assert all(0.8 < t < 10 for t in refused), refused  # a recall's answer time
        finally:
            writer.kill()
            writer.communicate()
