"""contrib/slurm: the per-job memfs Prolog and Epilog, run as Slurm would run them.

No Slurm here: the scripts run as subprocesses with the variables slurmd gives a
Prolog/Epilog (SLURM_JOB_ID, SLURM_JOB_UID/GID/USER, SLURM_JOB_WORK_DIR,
SLURM_JOB_COMMENT) and the site's MEMFS_* settings, against real memfs mounts.
The job's owner is ``nobody``, so the manifest is really read as the job's user.
What matters: the job finds its input in memory, what it wrote ends up in the
backing directory byte for byte (or in one tar), nothing is left mounted or
running afterwards, and a failure never loses data silently or leaves a mount.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memfs.cli.mounts import is_mounted, mount_type
from memfs.cli.runtime import pid_file
from tests.conftest import MEMFS, MOUNT_SKIP, stop_server, wait_gone

pytestmark = pytest.mark.mount

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "contrib" / "slurm"
PROLOG = SCRIPTS / "memfs-prolog.sh"
EPILOG = SCRIPTS / "memfs-epilog.sh"
JOB_ID = "4242"
NOBODY = 65534
SCRIPT_TIMEOUT = 200


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_sums(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every regular file under *root*."""
    return {
        str(p.relative_to(root)): sha(p.read_bytes())
        for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def daemon_pids(mnt: Path) -> list[int]:
    """memfs daemons serving *mnt*: argv holds ``mount MNT`` (the forked ``memfs mount``)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pairs = zip(argv, argv[1:], strict=False)
        if any(a == b"mount" and b == os.fsencode(mnt) for a, b in pairs):
            found.append(int(d.name))
    return found


def force_unmount(mnt: Path) -> None:
    """Whatever a failed test left at *mnt*: a mount, a daemon."""
    pids = daemon_pids(mnt)
    if is_mounted(str(mnt)):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)
    for pid in pids:
        if not wait_gone(pid, 30):
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid, 10)


@dataclass
class Node:
    """One compute node's worth of paths, and the environment slurmd would give."""

    tmp: Path
    base: Path  # MEMFS_MOUNT_BASE
    backing: Path  # MEMFS_BACKING
    workdir: Path  # the job's working directory (readable by the job's user)
    env: dict[str, str] = field(default_factory=dict)
    cleanups: list[Path] = field(default_factory=list)

    @property
    def mnt(self) -> Path:
        return self.base / JOB_ID

    def run(self, script: Path, **extra: str) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **extra}
        return subprocess.run(
            [str(script)], env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT,
        )

    def memfs(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MEMFS, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    if MOUNT_SKIP:
        pytest.skip(MOUNT_SKIP)
    # The job's user must reach its working directory: not under tmp_path (0700 parents).
    workdir = Path(tempfile.mkdtemp(prefix="memfs-slurm-job-", dir="/tmp"))
    workdir.chmod(0o755)
    backing = tmp_path / "backing"
    backing.mkdir()
    n = Node(tmp_path, tmp_path / "memfs", backing, workdir)
    n.env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "MEMFS": str(Path(sys.executable).parent / "memfs"),
        "MEMFS_SLURM_ENV": str(tmp_path / "no-such-config"),
        "MEMFS_MOUNT_BASE": str(n.base),
        "MEMFS_BACKING": str(backing),
        "MEMFS_SIZE": "256M",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_UID": str(NOBODY),
        "SLURM_JOB_GID": str(NOBODY),
        "SLURM_JOB_USER": "nobody",
        "SLURM_JOB_WORK_DIR": str(workdir),
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
    }
    n.cleanups.append(n.mnt)
    try:
        yield n
    finally:
        for mnt in n.cleanups:
            force_unmount(mnt)
        shutil.rmtree(workdir, ignore_errors=True)
    for mnt in n.cleanups:
        assert not is_mounted(str(mnt)), f"{mnt} left mounted"


def assert_logged(res: subprocess.CompletedProcess[str], tag: str, *phrases: str) -> None:
    lines = [line for line in res.stderr.splitlines() if line.startswith(f"{tag}: ")]
    assert lines, res.stderr
    text = "\n".join(lines)
    for phrase in phrases:
        assert phrase in text, res.stderr


def assert_nothing_left(n: Node, mnt: Path | None = None) -> None:
    mnt = mnt or n.mnt
    assert not is_mounted(str(mnt))
    assert daemon_pids(mnt) == []
    assert not mnt.exists(), f"mountpoint {mnt} left behind"


def status(n: Node) -> dict[str, object]:
    res = n.memfs("status", str(n.mnt), "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert isinstance(st, dict)
    return st


def tar_sums(archive: Path, top: str) -> dict[str, str]:
    """``{path below top: sha256}`` of the regular files in a tar written by stage-out."""
    out = {}
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            name = m.name.removeprefix("./")
            assert name == top or name.startswith(top + "/"), m.name
            if m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                out[name.removeprefix(top + "/")] = sha(f.read())
    return out


def test_job_lifecycle_embedded(node: Node) -> None:
    """Prolog stages in what the job's manifest names; the job reads it and writes;
    the epilog archives one tree, writes back the rest, and leaves nothing behind."""
    rng = random.Random(4)
    inputs = {
        "inputs/a.bin": rng.randbytes(1 << 20),
        "inputs/sub/b.txt": b"input b\n" * 1000,
        "inputs/c.bin": rng.randbytes(300_001),
    }
    write_tree(node.backing, {**inputs, "other/not-staged.bin": rng.randbytes(200_000)})
    (node.workdir / "inputs.manifest").write_text("# what the job reads\n\ninputs\n")
    env = {
        "SLURM_JOB_COMMENT": "project=x memfs_manifest=inputs.manifest memfs_stage_out=results",
        "MEMFS_FLUSH_DELAY": "600",  # nothing written back before the epilog asks for it
    }

    res = node.run(PROLOG, **env)
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-prolog", "mounted memfs at", "staged in", "ready:")
    assert mount_type(str(node.mnt)) == "fuse.memfs"
    root = node.mnt.stat()
    assert (root.st_uid, root.st_gid, stat.S_IMODE(root.st_mode)) == (NOBODY, NOBODY, 0o700)
    [pid] = daemon_pids(node.mnt)
    assert int(pid_file(str(node.mnt)).read_text()) == pid

    # Staged: the manifest's files are in memory before anything reads them,
    # the file it does not name is not.
    st = status(node)
    assert st["staging_files"] == 0, st
    assert st["evicted_files"] == 1, st
    assert tree_sums(node.mnt / "inputs") == tree_sums(node.backing / "inputs")

    # The job.
    results = {f"results/d{d}/r{i}.txt": f"result {d}.{i}\n".encode() * (i + 1)
               for d in range(3) for i in range(15)}
    out = {"out/big.bin": rng.randbytes(3 << 20), "out/notes.txt": b"done\n"}
    write_tree(node.mnt, {**results, **out})

    res = node.run(EPILOG, **env, SLURM_SCRIPT_CONTEXT="epilog_slurmd")
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", "staged out", "wrote back", "done:")
    assert_nothing_left(node)
    assert wait_gone(pid, 10)
    assert not pid_file(str(node.mnt)).exists()

    archive = node.backing / f"results-{JOB_ID}.tar"
    assert archive.stat().st_uid == NOBODY
    assert tar_sums(archive, "results") == {
        k.removeprefix("results/"): sha(v) for k, v in results.items()
    }
    # The archived tree was not also written back file by file; the rest was.
    assert not any(p.is_file() for p in (node.backing / "results").rglob("*"))
    assert tree_sums(node.backing / "out") == {
        k.removeprefix("out/"): sha(v) for k, v in out.items()
    }
    assert tree_sums(node.backing / "inputs") == {
        k.removeprefix("inputs/"): sha(v) for k, v in inputs.items()
    }


def test_site_config_file_and_prolog_run_twice(node: Node) -> None:
    """Settings from the site's file (which slurmd's bare environment needs), a
    per-user backing directory made on demand, and a second prolog run for the same
    job that must not mount again."""
    per_user = node.tmp / "lustre" / "nobody"
    config = node.tmp / "slurm.env"
    config.write_text(
        f'MEMFS_MOUNT_BASE="{node.base}"\n'
        f'MEMFS_BACKING="{node.tmp}/lustre/$SLURM_JOB_USER"\n'
        "MEMFS_BACKING_MKDIR=1\n"
        "MEMFS_SIZE=128M\n"
        "MEMFS_ROOT_MODE=0750\n"
    )
    env = {k: v for k, v in node.env.items() if not k.startswith("MEMFS_")}
    env["MEMFS"] = node.env["MEMFS"]
    env["MEMFS_SLURM_ENV"] = str(config)
    node.env = env

    res = node.run(PROLOG)
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-prolog", f"created the backing directory {per_user}")
    assert per_user.stat().st_uid == NOBODY
    assert stat.S_IMODE(node.mnt.stat().st_mode) == 0o750
    [pid] = daemon_pids(node.mnt)

    again = node.run(PROLOG)
    assert again.returncode == 0, again.stderr
    assert_logged(again, "memfs-prolog", "already mounted")
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    assert sum(f" {node.mnt} " in line for line in mounts) == 1
    assert daemon_pids(node.mnt) == [pid]

    (node.mnt / "x.txt").write_bytes(b"written by the job\n")
    res = node.run(EPILOG)
    assert res.returncode == 0, res.stderr
    assert_nothing_left(node)
    assert (per_user / "x.txt").read_bytes() == b"written by the job\n"


def test_prolog_missing_manifest_leaves_nothing(node: Node) -> None:
    res = node.run(PROLOG, SLURM_JOB_COMMENT="memfs_manifest=no-such.manifest")
    assert res.returncode != 0
    assert_logged(res, "memfs-prolog", f"stage-in manifest {node.workdir}/no-such.manifest",
                  "failed")
    assert "Traceback" not in res.stderr
    assert_nothing_left(node)


def test_prolog_reads_the_manifest_as_the_job_user(node: Node) -> None:
    """A manifest only root can read is the job's mistake (and not root's to read)."""
    private = node.tmp / "private.manifest"  # under tmp_path: 0700 root directories
    private.write_text("inputs\n")
    res = node.run(PROLOG, MEMFS_STAGE_IN_MANIFEST=str(private))
    assert res.returncode != 0
    assert_logged(res, "memfs-prolog", str(private), "user nobody")
    assert_nothing_left(node)


def test_prolog_stage_in_failure_unmounts(node: Node) -> None:
    """The mount is made, then stage-in fails (a name not in the backing directory):
    the prolog must undo the mount, so that no job runs without its input."""
    (node.backing / "here.bin").write_bytes(b"x" * 1000)
    (node.workdir / "m").write_text("here.bin\nnot-there.bin\n")
    res = node.run(PROLOG, SLURM_JOB_EXTRA="memfs_manifest=m")
    assert res.returncode != 0
    assert_logged(res, "memfs-prolog", "mounted memfs", "stage-in", "cleaning up", "failed")
    assert_nothing_left(node)
    assert (node.backing / "here.bin").read_bytes() == b"x" * 1000


def test_prolog_fails_when_a_staged_file_cannot_be_fetched(node: Node) -> None:
    """A file that vanished from the backing directory after the mount still shows in
    it (its entry was loaded at mount time) but cannot be fetched: memfs stage-in
    exits 1 naming it, and the prolog fails cleanly, unmounting."""
    (node.backing / "inputs").mkdir()
    (node.backing / "inputs" / "a.bin").write_bytes(b"a" * 100_000)
    (node.backing / "inputs" / "b.bin").write_bytes(b"b" * 100_000)
    (node.workdir / "m").write_text("inputs\n")
    # Between the mount and the stage-in: a memfs that removes the file first.
    wrapper = node.tmp / "memfs-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" != stage-in ] || rm -f -- "{node.backing}/inputs/b.bin"\n'
        f'exec "{node.env["MEMFS"]}" "$@"\n'
    )
    wrapper.chmod(0o755)
    res = node.run(PROLOG, SLURM_JOB_EXTRA="memfs_manifest=m", MEMFS=str(wrapper))
    assert res.returncode != 0
    assert f"memfs: error: stage-in of {node.mnt}/inputs/b.bin: " in res.stderr
    assert_logged(res, "memfs-prolog", "mounted memfs", "memfs stage-in exit 1",
                  "cleaning up", "failed")
    assert "Traceback" not in res.stderr
    assert_nothing_left(node)
    assert (node.backing / "inputs" / "a.bin").read_bytes() == b"a" * 100_000


def test_stage_out_tree_is_never_written_back_file_by_file(node: Node) -> None:
    """The prolog makes the job's stage-out tree (the job's, excluded from write-back)
    at job start: a job that runs longer than the flush delay does not see it
    written back file by file; the epilog archives it, and says the tree is
    gone with the mount."""
    env = {"SLURM_JOB_COMMENT": "memfs_stage_out=ckpt/run1", "MEMFS_FLUSH_DELAY": "0.3"}
    res = node.run(PROLOG, **env)
    assert res.returncode == 0, res.stderr
    tree = node.mnt / "ckpt" / "run1"
    assert_logged(res, "memfs-prolog", f"made {tree} for the job's stage-out")
    for d in (tree.parent, tree):
        assert (d.stat().st_uid, d.stat().st_gid) == (NOBODY, NOBODY)
    assert os.getxattr(tree, "user.memfs.flush") == b"off"

    ckpt = {f"ckpt/run1/step{i}/state.bin": os.urandom(50_000) for i in range(5)}
    write_tree(node.mnt, {**ckpt, "out.txt": b"out\n"})
    time.sleep(2)  # well past the flush delay
    assert (node.backing / "out.txt").read_bytes() == b"out\n"  # the rest is written back
    assert not any(p.is_file() for p in node.backing.rglob("*") if "ckpt" in p.parts)

    res = node.run(EPILOG, **env)
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", "staged out", "memfs umount: memfs: 5 files",
                  "are lost with the mount", "done:")
    assert_nothing_left(node)
    assert tar_sums(node.backing / f"run1-{JOB_ID}.tar", "run1") == {
        k.removeprefix("ckpt/run1/"): sha(v) for k, v in ckpt.items()}
    assert not any(p.is_file() for p in node.backing.rglob("*") if "ckpt" in p.parts)


def test_refused_stage_out_is_written_back_file_by_file(node: Node) -> None:
    """An archive memfs stage-out refuses (its directory is missing): the prolog's
    exclusion is lifted and the tree is written back file by file; nothing is lost."""
    env = {"SLURM_JOB_COMMENT": "memfs_stage_out=results"}
    res = node.run(PROLOG, **env)
    assert res.returncode == 0, res.stderr
    results = {f"results/r{i}": f"r{i}\n".encode() for i in range(3)}
    write_tree(node.mnt, results)
    res = node.run(EPILOG, **env, MEMFS_STAGE_OUT_ARCHIVE=str(node.tmp / "missing" / "r.tar"))
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", "memfs stage-out refused it", "file by file instead")
    assert "are lost with the mount" not in res.stderr
    assert_nothing_left(node)
    assert tree_sums(node.backing / "results") == {
        k.removeprefix("results/"): sha(v) for k, v in results.items()}


def test_prolog_leaves_a_bad_stage_out_tree_alone(node: Node) -> None:
    """'..' in the tree, or a symlink in the backing directory where it would go: logged,
    not made, nothing excluded; the prolog still succeeds."""
    (node.backing / "elsewhere").mkdir()
    (node.backing / "ln").symlink_to("elsewhere")
    for tree, says in (("../x", "without '..'"), ("ln/t", "is a symlink or not a directory")):
        res = node.run(PROLOG, SLURM_JOB_COMMENT=f"memfs_stage_out={tree}")
        assert res.returncode == 0, res.stderr
        assert_logged(res, "memfs-prolog", says)
        assert not (node.backing / "elsewhere" / "t").exists()
        with pytest.raises(OSError):
            os.getxattr(node.mnt / "elsewhere", "user.memfs.flush")
        res = node.run(EPILOG)
        assert res.returncode == 0, res.stderr
        assert_nothing_left(node)


def test_epilog_with_nothing_mounted(node: Node) -> None:
    res = node.run(EPILOG)
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", "nothing to do")
    node.mnt.mkdir(parents=True)  # a mountpoint left by an interrupted run
    res = node.run(EPILOG)
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", f"nothing mounted at {node.mnt}", "removed the empty")
    assert not node.mnt.exists()


def test_epilog_stage_out_must_stay_in_the_mount(node: Node) -> None:
    """A stage-out tree that leads out of the job's filesystem (root would archive
    /etc for the job) is refused; the job's files are still written back."""
    res = node.run(PROLOG)
    assert res.returncode == 0, res.stderr
    (node.mnt / "results").symlink_to("/etc")
    (node.mnt / "kept.txt").write_bytes(b"kept\n")
    res = node.run(EPILOG, SLURM_JOB_COMMENT="memfs_stage_out=results")
    assert res.returncode == 0, res.stderr
    assert_logged(res, "memfs-epilog", "is a symlink or leads out of", "file by file instead")
    assert_nothing_left(node)
    assert not list(node.backing.glob("*.tar"))
    assert os.readlink(node.backing / "results") == "/etc"
    assert (node.backing / "kept.txt").read_bytes() == b"kept\n"


def test_epilog_write_back_failure_keeps_the_data(node: Node) -> None:
    """The backing filesystem fills up: the epilog fails loudly and keeps the data
    mounted in memory; once there is room, running it again finishes the job."""
    small = node.tmp / "smallfs"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                   check=True, timeout=30)
    try:
        node.env["MEMFS_BACKING"] = str(small)
        res = node.run(PROLOG)
        assert res.returncode == 0, res.stderr
        data = random.Random(7).randbytes(4 << 20)
        (node.mnt / "big.bin").write_bytes(data)

        res = node.run(EPILOG, MEMFS_FLUSH_TIMEOUT="8")
        assert res.returncode != 0
        assert_logged(res, "memfs-epilog", "write-back", "stays mounted")
        assert "errors (" in res.stderr  # memfs status, shown for the admin
        assert mount_type(str(node.mnt)) == "fuse.memfs"
        assert sha((node.mnt / "big.bin").read_bytes()) == sha(data)

        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True, timeout=30)
        res = node.run(EPILOG, MEMFS_FLUSH_TIMEOUT="150")
        assert res.returncode == 0, res.stderr
        assert_nothing_left(node)
        assert sha((small / "big.bin").read_bytes()) == sha(data)
    finally:
        force_unmount(node.mnt)
        subprocess.run(["umount", str(small)], capture_output=True, timeout=30)


def start_server(argv: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A memd or mds on loopback port 0; returns it and the port it says it took."""
    with open(log, "wb") as err:
        proc = subprocess.Popen([*MEMFS, *argv], stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().decode() if ready else ""
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{argv[0]} did not start: {line!r}, log: {log.read_text()[-2000:]}")
    return proc, int(m[1])


def test_job_lifecycle_cluster(node: Node) -> None:
    """Against an mds that writes back: the job gets its own directory in the shared
    filesystem, its input staged in; the epilog archives a tree, removes it from the
    shared pool, writes back the rest of the job's directory and unmounts."""
    secret = node.tmp / "secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    secret.chmod(0o600)
    data = random.Random(9).randbytes(2 << 20)
    write_tree(node.backing, {"inputs/data.bin": data})
    (node.workdir / "in.txt").write_text("inputs/data.bin\n")
    servers: list[subprocess.Popen[bytes]] = []
    check = node.tmp / "check"
    try:
        memd, memd_port = start_server(
            ["memd", "--listen", "127.0.0.1:0", "--volumes", "2", "--volume-size", "64M",
             "--secret-file", str(secret)], node.tmp / "memd.log")
        servers.append(memd)
        spec = f"tcp://127.0.0.1:{memd_port}/0+tcp://127.0.0.1:{memd_port}/1"
        mds, mds_port = start_server(
            ["mds", "--listen", "127.0.0.1:0", "--pool", spec, "--secret-file", str(secret),
             "--backing", str(node.backing), "--flush-delay", "600"], node.tmp / "mds.log")
        servers.append(mds)
        env = {
            "MEMFS_MDS": f"127.0.0.1:{mds_port}",
            "MEMFS_SECRET_FILE": str(secret),
            "SLURM_JOB_COMMENT": "memfs_manifest=in.txt,memfs_stage_out=results",
        }
        res = node.run(PROLOG, **env)
        assert res.returncode == 0, res.stderr
        job = node.mnt / "nobody" / JOB_ID
        assert_logged(res, "memfs-prolog", "cluster client", f"gave {job} to user nobody")
        assert (job.stat().st_uid, stat.S_IMODE(job.stat().st_mode)) == (NOBODY, 0o700)
        assert sha((node.mnt / "inputs" / "data.bin").read_bytes()) == sha(data)

        results = {f"results/r{i}": f"r{i}\n".encode() * 100 for i in range(20)}
        out = {"out/o.bin": random.Random(10).randbytes(1 << 20)}
        write_tree(job, {**results, **out})

        res = node.run(EPILOG, **env)
        assert res.returncode == 0, res.stderr
        assert_logged(res, "memfs-epilog", "staged out", "removed", "wrote back", "done:")
        assert_nothing_left(node)
        archive = node.backing / f"results-{JOB_ID}.tar"
        assert tar_sums(archive, "results") == {
            k.removeprefix("results/"): sha(v) for k, v in results.items()
        }
        back = node.backing / "nobody" / JOB_ID
        assert tree_sums(back) == {k: sha(v) for k, v in out.items()}
        assert sha((node.backing / "inputs" / "data.bin").read_bytes()) == sha(data)

        # Another client of the same pool: the archived tree is gone from it (its
        # memory returned), the job's other files are there and clean.
        check.mkdir()
        res = node.memfs("mount", str(check), "--mds", env["MEMFS_MDS"],
                         "--secret-file", str(secret), "--log", str(node.tmp / "check.log"))
        assert res.returncode == 0, res.stderr
        assert not (check / "nobody" / JOB_ID / "results").exists()
        o_bin = (check / "nobody" / JOB_ID / "out" / "o.bin").read_bytes()
        assert sha(o_bin) == sha(out["out/o.bin"])
        res = node.memfs("status", str(check), "--json")
        assert res.returncode == 0, res.stderr
        st = json.loads(res.stdout)
        assert (st["pinned_bytes"], st["dirty_bytes"]) == (0, 0), st
    finally:
        force_unmount(node.mnt)
        force_unmount(check)
        for proc in servers:
            stop_server(proc)
    for log in (node.tmp / "memd.log", node.tmp / "mds.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
