"""The mount daemon's control socket, and the CLI commands that use it.

The real :func:`serve_control` on a real Unix socket, over a small fake
``Meta`` whose ``control()`` answers from a script; the CLI commands (``memfs
flush/status/stage-in/stage-out`` and the drain wait of ``umount``) run
in-process against such a daemon in a thread, with a temporary directory
entered in the mount table as a memfs mount.  What must hold:

* requests and replies round-trip, many on one connection, answered in order;
* the engine's errors (``FsError``) reach the client with errno and message;
* garbage, oversized lines, idle and surplus connections close that
  connection only, with an EINVAL/EBUSY reply and at most a warning;
* only root, the daemon's user and the owner of the mount root are served
  (others are told who may, cannot crowd them out, and cost one log line); the
  socket is 0666 (its directory decides who reaches it) and removed when the
  server stops;
* the CLI sends paths relative to the mount, waits for tickets, and reports
  errors in one line (exit 2 for mistakes, 1 for failures).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from memfs import cli, control
from memfs.backing.status import BackingStatus, TicketProgress
from memfs.cli import (
    cmd_flush,
    cmd_stage_in,
    cmd_stage_out,
    cmd_umount,
    common,
    mounts,
    runtime,
)
from memfs.cli import tickets as cli_tickets
from memfs.cli.cmd_status import format_status
from memfs.cli.mounts import MountEntry
from memfs.cli.progress import progress_text
from memfs.control import ControlClient, serve_control
from memfs.errors import ControlError, FsError, UsageError
from memfs.host import Peer
from memfs.meta import Meta

NOBODY = 65534

STATUS: dict[str, Any] = {
    "backing": "/lustre/job42", "capacity": 4 << 30, "used": 1 << 30,
    "dirty_bytes": 3 << 20, "dirty_files": 3, "dirty_max": 2 << 30, "pinned_bytes": 0,
    "queued_files": 2, "flushing_files": 1, "namespace_ops": 4, "flush_rate": 150.5 * (1 << 20),
    "flushed_bytes": 10 << 30, "flushed_files": 1234, "resident_files": 77,
    "evicted_files": 5, "evicted_bytes_total": 7 << 20, "fetched_bytes": 9 << 20,
    "staging_files": 0, "staging_bytes": 0, "writers_waiting": 2, "draining": False,
    "errors": [{"path": "out/a.dat", "error": "[Errno 28] No space left on device",
                "count": 3, "last": 1_700_000_000.0}],
    "flush_delay": 5.0, "workers": 4,
}


class FakeMeta:
    """``Meta.control`` from a script: ``handlers[op](args)`` returns the result or raises.

    ``getattr(1)`` (the control server asks who owns the mount root) answers *owner*.
    """

    def __init__(self, handlers: dict[str, Callable[[dict[str, Any]], Any]] | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.handlers = handlers or {}
        self.owner = 0
        self.getattrs = 0

    async def getattr(self, ino: int) -> Any:
        assert ino == 1
        self.getattrs += 1
        return types.SimpleNamespace(ino=1, uid=self.owner, gid=self.owner)

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((op, args))
        handler = self.handlers.get(op)
        if handler is None:
            raise FsError(errno.EINVAL, f"unknown control operation {op!r}")
        result = handler(args)
        if callable(result):  # an async function to await: the engine taking its time
            return cast(dict[str, Any], await result())
        return cast(dict[str, Any], result)


def raises(exc: Exception) -> Callable[[dict[str, Any]], Any]:
    def handler(args: dict[str, Any]) -> Any:
        raise exc

    return handler


def echo(args: dict[str, Any]) -> dict[str, Any]:
    return {"echo": args}


def as_meta(fake: FakeMeta) -> Meta:
    return cast(Meta, fake)


@pytest.fixture
def sock_path() -> Iterator[str]:
    """A short directory: Unix socket paths are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="memfs-ctl-", dir="/tmp")
    yield os.path.join(d, "ctl")
    shutil.rmtree(d)


def expect_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.expected_warnings = True  # type: ignore[attr-defined]


def no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A bad client costs the daemon a warning at most: never an ERROR or a traceback."""
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


async def raw_exchange(path: str, data: bytes, limit: float = 10) -> list[Any]:
    """Send *data* and EOF, then read replies until the server closes: the decoded lines."""
    stream = await trio.open_unix_socket(path)
    async with stream:
        with trio.fail_after(limit):
            await stream.send_all(data)
            await stream.send_eof()
            buf = b""
            try:
                while chunk := await stream.receive_some(65536):
                    buf += chunk
            except trio.BrokenResourceError:
                pass
    return [json.loads(line) for line in buf.splitlines()]


async def read_reply(stream: trio.SocketStream, buf: bytearray) -> Any:
    """The next reply; None once the server has closed the connection."""
    while b"\n" not in buf:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:  # closed with our data unread: ECONNRESET
            return None
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\n")
    line = bytes(buf[:end])
    del buf[: end + 1]
    return json.loads(line)


# -- the server ----------------------------------------------------------------------------


async def test_round_trip(sock_path: str) -> None:
    fake = FakeMeta({"status": lambda a: STATUS, "flush": lambda a: {"ticket": 7}})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(fake))

        def client() -> tuple[dict[str, Any], dict[str, Any]]:
            with ControlClient(sock_path, "/mnt") as c:
                return c.call("status"), c.call("flush", {"paths": ["a/b", ""]})

        st, flushed = await trio.to_thread.run_sync(client)
        nursery.cancel_scope.cancel()
    assert st == STATUS
    assert flushed == {"ticket": 7}
    assert fake.calls == [("status", {}), ("flush", {"paths": ["a/b", ""]})]


async def test_many_requests_on_one_connection(sock_path: str) -> None:
    """The CLI polls progress on one connection; pipelined requests are answered in order."""
    fake = FakeMeta({"echo": echo})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(fake))

        def client() -> list[dict[str, Any]]:
            with ControlClient(sock_path, "/mnt") as c:
                return [c.call("echo", {"i": i}) for i in range(200)]

        replies = await trio.to_thread.run_sync(client)
        assert replies == [{"echo": {"i": i}} for i in range(200)]
        # Three requests in one write, one of them failing: three replies, in order.
        stream = await trio.open_unix_socket(sock_path)
        async with stream:
            await stream.send_all(b'{"op":"echo","args":{"i":1}}\n{"op":"nope","args":{}}\n'
                                  b'{"op":"echo"}\n')
            buf = bytearray()
            got = [await read_reply(stream, buf) for _ in range(3)]
        nursery.cancel_scope.cancel()
    assert got == [
        {"ok": {"echo": {"i": 1}}},
        {"error": "unknown control operation 'nope'", "errno": errno.EINVAL},
        {"ok": {"echo": {}}},  # "args" may be left out
    ]


async def test_engine_errors_reach_the_client(sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """FsError: its errno and message; anything else: EIO, and the traceback in the log.
    The connection stays usable after either."""
    fake = FakeMeta({"progress": raises(FsError(errno.ENOENT, "no such ticket 12")),
                     "status": raises(RuntimeError("engine bug")), "echo": echo,
                     "unencodable": lambda a: {"x": object()}})
    expect_warnings(caplog)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(fake))

        def client() -> list[Any]:
            out: list[Any] = []
            with ControlClient(sock_path, "/mnt") as c:
                for op in ("progress", "nope", "status", "unencodable", "echo"):
                    try:
                        out.append(c.call(op, {"ticket": 12}))
                    except ControlError as exc:
                        out.append((exc.errno, str(exc)))
            return out

        got = await trio.to_thread.run_sync(client)
        nursery.cancel_scope.cancel()
    assert got[0] == (errno.ENOENT, "no such ticket 12")
    assert got[1] == (errno.EINVAL, "unknown control operation 'nope'")
    assert got[2][0] == errno.EIO and "RuntimeError: engine bug" in got[2][1]
    assert got[3][0] == errno.EIO and "TypeError" in got[3][1]
    assert got[4] == {"echo": {"ticket": 12}}
    logged = [r for r in caplog.records if r.name == "memfs.control" and r.exc_info]
    assert [r.getMessage() for r in logged] == ["control status failed", "control unencodable failed"]


BAD_REQUESTS = {
    "not_json": b"{not json\n",
    "bad_utf8": b'{"op": "\xff"}\n',
    "array": b'["status", {}]\n',
    "string": b'"status"\n',
    "no_op": b'{"args": {}}\n',
    "op_not_string": b'{"op": 5, "args": {}}\n',
    "op_empty": b'{"op": "", "args": {}}\n',
    "args_not_object": b'{"op": "status", "args": []}\n',
    "unknown_key": b'{"op": "status", "args": {}, "x": 1}\n',
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "huge_number": b'{"op": "status", "args": {"n": ' + b"9" * 5000 + b"}}\n",
    "unterminated": b'{"op": "status", "args": {}}',
}


@pytest.mark.parametrize("data", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
async def test_malformed_requests(
    sock_path: str, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """EINVAL, then the connection is closed; the engine never sees it; others carry on."""
    expect_warnings(caplog)
    fake = FakeMeta({"status": lambda a: STATUS, "echo": echo})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(fake))
        stream = await trio.open_unix_socket(sock_path)
        async with stream:
            await stream.send_all(data)
            if data.endswith(b"}"):
                await stream.send_eof()
            buf = bytearray()
            reply = await read_reply(stream, buf)
            assert await read_reply(stream, buf) is None  # closed after the error
        assert reply["errno"] == errno.EINVAL, reply
        assert fake.calls == []
        assert await raw_exchange(sock_path, b'{"op":"echo","args":{"a":1}}\n') == [
            {"ok": {"echo": {"a": 1}}}
        ]
        nursery.cancel_scope.cancel()
    no_errors_logged(caplog)
    assert any(r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("newline", [False, True], ids=["streaming", "whole-line"])
async def test_oversize_line(sock_path: str, newline: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A request above 1 MiB is refused as soon as the limit is passed, not buffered on."""
    expect_warnings(caplog)
    fake = FakeMeta({"echo": echo})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(fake))
        stream = await trio.open_unix_socket(sock_path)
        payload = b'{"op":"echo","args":{"x":"' + b"a" * (control.MAX_LINE + 10)
        if newline:
            payload += b'"}}\n'
        async with stream:

            async def send() -> None:
                try:
                    await stream.send_all(payload)
                    if not newline:  # a client that just keeps going
                        while True:
                            await stream.send_all(b"a" * 65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(send)
            with trio.fail_after(10):
                buf = bytearray()
                reply = await read_reply(stream, buf)
                assert await read_reply(stream, buf) is None
        assert reply == {"error": "request longer than 1 MiB", "errno": errno.EINVAL}
        assert fake.calls == []
        # Exactly at the limit is fine.
        line = b'{"op":"echo","args":{"x":"'
        line += b"b" * (control.MAX_LINE - len(line) - 3) + b'"}}'
        assert len(line) == control.MAX_LINE
        [ok] = await raw_exchange(sock_path, line + b"\n")
        assert ok["ok"]["echo"]["x"].startswith("bbb")
        nursery.cancel_scope.cancel()
    no_errors_logged(caplog)


async def test_oversize_request_from_the_client_gets_the_reason(
    sock_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server reads on a little after refusing, so a client still sending hears why
    (not ECONNRESET/EPIPE); the connection is closed afterwards."""
    expect_warnings(caplog)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))

        def client() -> ControlError:
            with ControlClient(sock_path, "/m") as c:
                with pytest.raises(ControlError) as info:
                    c.call("echo", {"x": "a" * (3 << 20)})
                with pytest.raises(ControlError, match="lost the connection"):
                    c.call("echo")
            return info.value

        exc = await trio.to_thread.run_sync(client)
        nursery.cancel_scope.cancel()
    assert (exc.errno, exc.message) == (errno.EINVAL, "request longer than 1 MiB")


async def test_socket_file_mode_and_removal(sock_path: str) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta()))
        st = os.lstat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        # Anyone who can enter the directory may connect: the peer check decides.
        assert stat.S_IMODE(st.st_mode) == 0o666
        nursery.cancel_scope.cancel()
    assert not os.path.lexists(sock_path)  # noqa: ASYNC240 - a local stat


async def test_stale_socket_is_replaced_other_files_are_not(sock_path: str) -> None:
    """A SIGKILLed daemon leaves its socket behind: the next one takes the name over.
    Anything that is not a socket is not ours to delete."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(sock_path)  # never listened on, closed: as a dead daemon's
    with pytest.raises(UsageError, match="is the memfs daemon of /mnt running"):
        ControlClient(sock_path, "/mnt").connect()  # refused: stale
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))
        assert await raw_exchange(sock_path, b'{"op":"echo"}\n') == [{"ok": {"echo": {}}}]
        nursery.cancel_scope.cancel()
    await trio.Path(sock_path).write_text("not a socket")
    with pytest.raises(FileExistsError):
        await serve_control(sock_path, as_meta(FakeMeta()))
    assert await trio.Path(sock_path).read_text() == "not a socket"


async def test_removal_leaves_a_newer_socket_alone(sock_path: str) -> None:
    """If another daemon has taken the name over meanwhile, stopping must not unlink its socket."""
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta()))
        os.unlink(sock_path)
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(sock_path)
            nursery.cancel_scope.cancel()
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)


async def test_idle_connections_are_closed(
    sock_path: str, autojump_clock: trio.abc.Clock
) -> None:
    """300 s without a complete request closes the connection; requests reset the clock."""
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))
        stream = await trio.open_unix_socket(sock_path)
        buf = bytearray()
        async with stream:
            start = trio.current_time()
            for i in range(3):
                await trio.sleep(250)
                await stream.send_all(b'{"op":"echo","args":{"i":%d}}\n' % i)
                assert await read_reply(stream, buf) == {"ok": {"echo": {"i": i}}}
            await stream.send_all(b'{"op":"ec')  # a request begun, never finished
            assert await read_reply(stream, buf) is None
            assert trio.current_time() - start == pytest.approx(750 + control.IDLE_TIMEOUT)
        nursery.cancel_scope.cancel()


async def test_a_hung_engine_call_times_out(
    sock_path: str, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    expect_warnings(caplog)

    def hang(args: dict[str, Any]) -> Callable[[], Any]:
        return trio.sleep_forever

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"flush": hang})))
        replies = await raw_exchange(sock_path, b'{"op":"flush","args":{}}\n', limit=100)
        nursery.cancel_scope.cancel()
    assert replies == [{"error": "flush: no answer within 60 s", "errno": errno.ETIMEDOUT}]
    no_errors_logged(caplog)


async def test_too_many_connections(sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    expect_warnings(caplog)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))
        streams = []
        try:
            for i in range(control.MAX_CONNECTIONS):
                s = await trio.open_unix_socket(sock_path)
                streams.append(s)
                await s.send_all(b'{"op":"echo","args":{"i":%d}}\n' % i)
                assert await read_reply(s, bytearray()) == {"ok": {"echo": {"i": i}}}
            assert await raw_exchange(sock_path, b'{"op":"echo"}\n') == [
                {"error": "too many control connections", "errno": errno.EBUSY}
            ]
            await streams.pop().aclose()
            await trio.sleep(0.05)  # the server notices the close
            assert await raw_exchange(sock_path, b'{"op":"echo"}\n') == [{"ok": {"echo": {}}}]
        finally:
            for s in streams:
                await s.aclose()
        nursery.cancel_scope.cancel()
    no_errors_logged(caplog)


async def test_a_stuck_client_does_not_block_others(sock_path: str) -> None:
    """One connection holding half a request and never reading; another is served meanwhile."""
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))
        stuck = await trio.open_unix_socket(sock_path)
        async with stuck:
            await stuck.send_all(b'{"op":"echo","args":{"x":1}}\n' * 1000 + b'{"op":')
            with trio.fail_after(5):
                for i in range(20):
                    assert await raw_exchange(sock_path, b'{"op":"echo","args":{"i":%d}}\n' % i) \
                        == [{"ok": {"echo": {"i": i}}}]
        nursery.cancel_scope.cancel()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
async def test_other_users_are_refused_but_the_mount_owner_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uid nobody gets EACCES and nothing is run, saying who may; once the mount's
    root directory is nobody's (the Slurm prolog chowns it to the job's user),
    nobody is served, asked afresh at each connection."""
    expect_warnings(caplog)
    d = tempfile.mkdtemp(prefix="memfs-ctl-", dir="/tmp")
    path = os.path.join(d, "ctl")
    client = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.settimeout(10)\n"
        f"s.connect({path!r})\n"
        "s.sendall(b'{\"op\": \"echo\", \"args\": {}}\\n')\n"
        "s.shutdown(socket.SHUT_WR)\n"
        "data = b''\n"
        "while chunk := s.recv(4096):\n"
        "    data += chunk\n"
        "sys.stdout.write(data.decode())\n"
    )
    fake = FakeMeta({"echo": echo})

    async def as_nobody() -> list[Any]:
        # The venv's interpreter may live where nobody cannot reach (/root/.pyenv).
        for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
            try:
                res = await trio.run_process(
                    [python, "-I", "-c", client], user=NOBODY, group=NOBODY,
                    extra_groups=[], capture_stdout=True, capture_stderr=True, check=False,
                    cwd="/",
                )
            except PermissionError:
                continue
            assert res.returncode == 0, res.stderr
            return [json.loads(x) for x in res.stdout.splitlines()]
        pytest.skip("no Python interpreter that uid nobody may run")

    try:
        os.chmod(d, 0o755)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, path, as_meta(fake))
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
            assert await as_nobody() == [{
                "error": f"uid {NOBODY} may not control this mount: only root and the owner "
                         "of the mount (uid 0) may",
                "errno": errno.EACCES, "owner": 0,
            }]
            assert fake.calls == []
            assert await raw_exchange(path, b'{"op":"echo"}\n') == [{"ok": {"echo": {}}}]  # root
            fake.owner = NOBODY  # chown MNT
            assert await as_nobody() == [{"ok": {"echo": {}}}]
            assert fake.calls == [("echo", {}), ("echo", {})]
            fake.owner = 1234  # given to someone else again
            assert (await as_nobody())[0]["errno"] == errno.EACCES
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(d)
    assert any("refused a connection from uid 65534" in r.getMessage() for r in caplog.records)
    no_errors_logged(caplog)


async def test_refused_peers_cannot_crowd_out_the_owner(
    sock_path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The socket is reachable by every user: a flood of connections from one who may
    not use it (never reading the refusal) takes no slot from those who may, costs
    one log line, and each refused connection is closed within about two seconds."""
    expect_warnings(caplog)
    stranger = [True]
    real_peer = control._peer
    monkeypatch.setattr(control, "_peer",
                        lambda sock: Peer(1, 4321, 4321) if stranger[0] else real_peer(sock))
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, as_meta(FakeMeta({"echo": echo})))
        flood = []
        try:
            for _ in range(control.MAX_CONNECTIONS + control.MAX_REFUSALS + 10):
                s = await trio.open_unix_socket(sock_path)
                flood.append(s)
                with contextlib.suppress(trio.BrokenResourceError):  # closed already
                    await s.send_all(b'{"op":"echo"}\n' * 10000)  # and never reads
            await trio.sleep(0.1)
            stranger[0] = False
            with trio.fail_after(1):  # served at once, not after the refusals
                assert await raw_exchange(sock_path, b'{"op":"echo"}\n') == [{"ok": {"echo": {}}}]
            with trio.fail_after(control.REFUSE_TIMEOUT + control.LINGER + 2):
                for s in flood:  # each refused connection is closed by the server
                    try:
                        while await s.receive_some(1 << 16):
                            pass
                    except trio.BrokenResourceError:
                        pass
        finally:
            for s in flood:
                await s.aclose()
        nursery.cancel_scope.cancel()
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1
    no_errors_logged(caplog)


# -- the client ----------------------------------------------------------------------------


def test_client_without_a_daemon(sock_path: str) -> None:
    with pytest.raises(UsageError, match=r"^no control socket .*ctl: is the memfs daemon of /mnt/x running\?$"):
        with ControlClient(sock_path, "/mnt/x"):
            pass


class RawServer:
    """A Unix socket server in a thread that answers every line with *reply* (or closes)."""

    def __init__(self, path: str, reply: bytes | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(1)
        self.reply = reply
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            if self.reply is not None:
                conn.sendall(self.reply)
                conn.settimeout(5)
                while conn.recv(65536):  # until the client hangs up
                    pass

    def close(self) -> None:
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("reply, err, message", [
    (None, errno.EIO, "lost the connection to the daemon of /m"),
    (b"garbage\n", errno.EPROTO, "the daemon of /m sent a malformed reply"),
    (b'{"ok": [1]}\n', errno.EPROTO, "the daemon of /m sent a malformed reply"),
    (b'{"error": "x"}\n', errno.EPROTO, "the daemon of /m sent a malformed reply"),
    (b'{"ok": {}', errno.ETIMEDOUT, "no answer from the daemon of /m in time"),
], ids=["closed", "not-json", "ok-not-object", "error-without-errno", "no-newline"])
def test_client_bad_replies(sock_path: str, reply: bytes | None, err: int, message: str) -> None:
    server = RawServer(sock_path, reply)
    try:
        with ControlClient(sock_path, "/m", timeout=0.5) as c:
            with pytest.raises(ControlError) as info:
                c.call("status")
        assert info.value.errno == err
        assert str(info.value).startswith(message), str(info.value)
    finally:
        server.close()


def test_control_socket_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Root's daemons: in /run/memfs-ctl (not with the pid and log files in the
    private /run/memfs), so that a mount root's owner can reach them; a user's:
    their runtime directory.  Always short enough for a Unix socket address, and
    unique.  A user's CLI tries their own daemon's place, then root's."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert runtime.control_socket("/mnt/memfs") == Path("/run/memfs-ctl/mnt-memfs.ctl")
    assert runtime.pid_file("/mnt/memfs") == Path("/run/memfs/mnt-memfs.pid")
    assert runtime.control_sockets("/mnt/memfs") == [Path("/run/memfs-ctl/mnt-memfs.ctl")]
    deep = "/scratch/" + "/".join(["a-long-directory-name"] * 8)
    path = runtime.control_socket(deep)
    assert len(os.fsencode(path)) <= 107
    assert path.parent == runtime.ROOT_CONTROL_DIR
    assert path == runtime.control_socket(deep)
    assert path != runtime.control_socket(deep + "x")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime.control_sockets("/mnt/memfs") == [
        tmp_path / "memfs" / "mnt-memfs.ctl", Path("/run/memfs-ctl/mnt-memfs.ctl")]


def test_control_directory_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root's socket directory is enterable by all (0755, also when it was made
    0700 before); a user's runtime directory stays private."""
    shared = tmp_path / "run" / "memfs-ctl"
    monkeypatch.setattr(runtime, "ROOT_CONTROL_DIR", shared)
    old = os.umask(0o077)
    try:
        runtime.make_control_dir(shared)
        assert stat.S_IMODE(shared.stat().st_mode) == 0o755
        shared.chmod(0o700)
        runtime.make_control_dir(shared)
        assert stat.S_IMODE(shared.stat().st_mode) == 0o755
        private = tmp_path / "user" / "memfs"
        runtime.make_control_dir(private)
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        os.umask(old)


# -- the CLI against a daemon --------------------------------------------------------------


class DaemonThread:
    """``serve_control`` over a :class:`FakeMeta` in its own thread and trio run."""

    def __init__(self, path: str, fake: FakeMeta) -> None:
        self.path = path
        self.fake = fake
        self.ready = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self.cancel: trio.CancelScope | None = None
        self.thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "control server did not start"

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self.cancel:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_control, self.path, as_meta(self.fake))
                self.ready.set()

    def stop(self) -> None:
        if self.thread.is_alive():
            assert self.token is not None and self.cancel is not None
            self.token.run_sync_soon(self.cancel.cancel)
            self.thread.join(10)
        assert not self.thread.is_alive()


class Env:
    """A directory that the CLI takes for a memfs mount whose daemon is *fake*."""

    def __init__(self, mnt: Path, sock: str, fake: FakeMeta) -> None:
        self.mnt = mnt
        self.sock = sock
        self.fake = fake
        self.daemon: DaemonThread | None = None

    def start(self) -> None:
        self.daemon = DaemonThread(self.sock, self.fake)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


@pytest.fixture
def env(tmp_path: Path, sock_path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real_table = mounts.mount_table
    monkeypatch.setattr(mounts, "mount_table",
                        lambda: [*real_table(), MountEntry("memfs", str(mnt), "fuse.memfs")])
    monkeypatch.setattr(runtime, "control_socket", lambda m: Path(sock_path) if m == str(mnt) else None)
    monkeypatch.setattr(cli_tickets, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(cmd_umount, "POLL_INTERVAL", 0.01)
    e = Env(mnt, sock_path, FakeMeta())
    try:
        yield e
    finally:
        e.stop()


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfs: error: "), err
    return lines[0]


def progress_script(steps: list[dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A "progress" handler that walks through *steps*, then stays at the last."""
    it = iter(steps)
    last: list[dict[str, Any]] = []

    def progress(args: dict[str, Any]) -> dict[str, Any]:
        assert args == {"ticket": 7}
        step = next(it, None)
        if step is not None:
            last[:] = [step]
        return last[0]

    return progress


def step(files: int, left: int, done: bool = False, errors: list[dict[str, Any]] | None = None
         ) -> dict[str, Any]:
    return {"done": done, "files": files, "bytes": left, "total_files": 3,
            "total_bytes": 3 << 20, "errors": errors or []}


def test_flush_sends_paths_relative_to_the_mount(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (env.mnt / "out" / "sub").mkdir(parents=True)
    (env.mnt / "link").symlink_to(env.mnt / "out")
    env.fake.handlers = {"flush": lambda a: {"ticket": 7},
                         "progress": progress_script([step(2, 2 << 20), step(0, 0, True)])}
    (env.mnt / "out" / "x").write_text("x")
    (env.mnt / "out" / "sub" / "f").write_text("f")
    (env.mnt / "top").mkdir()
    env.start()
    monkeypatch.chdir(env.mnt / "out")
    # "top" is not in the working directory but at the mount root: taken from there.
    code, out, err = run_cli(capsys, "flush", str(env.mnt), "sub", "../out/x", str(env.mnt),
                             str(env.mnt / "link" / "sub" / "f"), "sub", "top")
    assert (code, out, err) == (0, "", "")
    assert env.fake.calls == [("flush", {"paths": ["out/sub", "out/x", "", "out/sub/f", "top"]})]
    # Everything; --wait polls until done, quietly when not on a terminal.
    code, out, err = run_cli(capsys, "flush", str(env.mnt), "--wait")
    assert (code, out, err) == (0, "", "")
    assert env.fake.calls[1] == ("flush", {"paths": []})
    assert [c[0] for c in env.fake.calls[2:]] == ["progress", "progress"]


def test_flush_paths_outside_the_mount(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env.start()
    (tmp_path / "mnt2").mkdir()
    (env.mnt / "escape").symlink_to(tmp_path)
    monkeypatch.chdir(env.mnt)
    for path in (str(tmp_path), "..", "../mnt2/x", str(env.mnt) + "2/x", "escape/x"):
        code, out, err = run_cli(capsys, "flush", str(env.mnt), path)
        assert code == cli.EXIT_USAGE and out == ""
        assert f"{path} is not inside {env.mnt}" in one_error_line(err)
    assert env.fake.calls == []


def test_flush_wait_progress_on_a_terminal(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redrawn progress line, and each new write-back error once, while retrying."""
    failing = {"path": "out/a.dat", "error": "[Errno 28] No space left on device",
               "count": 1, "last": 100.0}
    again = {**failing, "count": 2, "last": 101.0}
    env.fake.handlers = {"flush": lambda a: {"ticket": 7}, "progress": progress_script([
        step(3, 3 << 20), step(2, 2 << 20, errors=[failing]), step(2, 2 << 20, errors=[failing]),
        step(1, 1 << 20, errors=[failing, again]), step(0, 0, True, errors=[failing, again]),
    ])}
    env.start()
    monkeypatch.setattr(cmd_flush, "stderr_is_terminal", lambda: True)
    code, out, err = run_cli(capsys, "flush", str(env.mnt), "--wait")
    assert (code, out) == (0, "")
    assert "\rflushing: 0/3 files, 3.0 MiB/3.0 MiB left\x1b[K" in err
    assert "\rflushing: 2/3 files, 1.0 MiB/3.0 MiB left" in err
    note = "memfs: write-back of out/a.dat: [Errno 28] No space left on device (retrying)\n"
    assert err.count(note) == 2  # two distinct failures, each shown once
    assert err.endswith("\r\x1b[K")  # the line is cleared at the end
    code, out, err = run_cli(capsys, "flush", str(env.mnt), "--wait", "--quiet")
    assert (code, out, err) == (0, "", "")


def test_status(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env.fake.handlers = {"status": lambda a: STATUS}
    env.start()
    code, out, err = run_cli(capsys, "status", str(env.mnt), "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == STATUS
    code, out, err = run_cli(capsys, "status", str(env.mnt))
    assert (code, err) == (0, "")
    for text in (
        "backing:    /lustre/job42",
        "pool:       1.0 GiB used of 4.0 GiB (25%)",
        "dirty:      3.0 MiB in 3 files (cap 2.0 GiB)",
        "write-back: 2 files queued, 1 in flight, 4 namespace changes pending; 150.5 MiB/s\n",
        "10.0 GiB in 1234 files since mount (delay 5.0 s, 4 workers)",
        "77 in memory, 5 only in the backing directory",
        "stage-in:   idle",
        "writers waiting on the dirty cap: 2",
        "out/a.dat: [Errno 28] No space left on device (x3)",
    ):
        assert text in out, (text, out)


def test_format_status_tolerates_missing_and_odd_values() -> None:
    text = format_status("/m", BackingStatus.from_json(
        {"capacity": 0, "flush_rate": float("nan"), "errors": [5]}))
    assert "pool:       0 B used of 0 B\n" in text and "errors:     none" in text
    assert "draining" in format_status("/m", BackingStatus.from_json({"draining": True}))


def test_daemon_errors(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """No backing directory: a usage error (2); the engine failing: exit 1; both one line."""
    env.fake.handlers = {
        "status": raises(FsError(errno.ENOTSUP, "this filesystem has no backing directory (--backing)")),
        "flush": raises(FsError(errno.EIO, "out: Input/output error")),
    }
    env.start()
    code, out, err = run_cli(capsys, "status", str(env.mnt))
    assert code == cli.EXIT_USAGE and out == ""
    assert one_error_line(err) == \
        f"memfs: error: {env.mnt}: this filesystem has no backing directory (--backing)"
    (env.mnt / "out").mkdir()
    code, out, err = run_cli(capsys, "flush", str(env.mnt), str(env.mnt / "out"))
    assert code == cli.EXIT_FAILED and out == ""
    assert one_error_line(err) == "memfs: error: out: Input/output error"


def test_daemon_not_running(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("flush", "status", "stage-in"):
        code, out, err = run_cli(capsys, cmd, str(env.mnt))
        assert code == cli.EXIT_USAGE and out == ""
        assert f"no control socket {env.sock}: is the memfs daemon of {env.mnt} running?" \
            in one_error_line(err)


def test_commands_refuse_what_is_not_a_memfs_mount(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cmd in ("flush", "status", "stage-in"):
        code, out, err = run_cli(capsys, cmd, str(tmp_path))
        assert code == cli.EXIT_USAGE and out == ""
        assert f"{tmp_path} is not a memfs mount" in one_error_line(err)
    code, out, err = run_cli(capsys, "status", "/proc")
    assert "/proc is a proc mount, not memfs" in one_error_line(err)


def test_stage_in_manifest(env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "manifest"
    manifest.write_text(f"# inputs of job 42\n\ninput/a.h5\n  {env.mnt}/input/b.h5  \n"
                        "./refs\n# input/skipped\ninput/a.h5\n")
    env.fake.handlers = {"stage_in": lambda a: {"ticket": 7},
                         "progress": progress_script([step(1, 1 << 20), step(0, 0, True)]),
                         "status": lambda a: STATUS}
    (env.mnt / "extra").mkdir()
    env.start()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), str(env.mnt / "extra"),
                             "--manifest", str(manifest))
    assert (code, out, err) == (0, "", "")
    assert env.fake.calls[0] == ("stage_in", {"paths": ["extra", "input/a.h5", "input/b.h5", "refs"]})
    assert [c[0] for c in env.fake.calls[1:]] == ["progress", "progress", "status"]
    # --no-wait: how much is being fetched, and where to see the rest; no paths: everything.
    env.fake.calls.clear()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--no-wait")
    assert (code, out, err) == (
        0, f"staging in 3 files (3.0 MiB) in the background; `memfs status {env.mnt}` "
           "shows what is left\n", "")
    assert [c[0] for c in env.fake.calls] == ["stage_in", "progress", "status"]
    assert env.fake.calls[0] == ("stage_in", {"paths": []})
    # An empty manifest names nothing: it must not stage everything.
    env.fake.calls.clear()
    manifest.write_text("# nothing today\n\n")
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest))
    assert (code, out, err, env.fake.calls) == (0, "", "", [])


def test_stage_in_many_paths_take_several_requests(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest of 15,000 files is more than one 1 MiB request: several tickets, all waited for."""
    names = [f"inputs/run-{i:06d}/data-file-with-a-long-name.h5" for i in range(15_000)]
    manifest = tmp_path / "manifest"
    manifest.write_text("\n".join(names) + "\n")
    tickets = iter(range(100, 200))
    done: set[int] = set()

    def progress(args: dict[str, Any]) -> dict[str, Any]:
        t = args["ticket"]
        first = t not in done
        done.add(t)
        return {"done": not first, "files": 1 if first else 0, "bytes": 0, "total_files": 1,
                "total_bytes": 0, "errors": []}

    env.fake.handlers = {"stage_in": lambda a: {"ticket": next(tickets)}, "progress": progress}
    env.start()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest))
    assert (code, out, err) == (0, "", "")
    requests = [a["paths"] for op, a in env.fake.calls if op == "stage_in"]
    assert len(requests) > 1
    assert [p for r in requests for p in r] == names  # all of them, once, in order
    assert {a["ticket"] for op, a in env.fake.calls if op == "progress"} == \
        set(range(100, 100 + len(requests)))
    env.fake.calls.clear()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest),
                             "--no-wait")
    assert (code, err) == (0, "")
    assert out.startswith(f"staging in {len(requests)} files (0 B) in the background")


def test_stage_in_manifest_mistakes(env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env.start()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(tmp_path / "none"))
    assert code == cli.EXIT_USAGE
    assert f"cannot read manifest {tmp_path / 'none'}: No such file or directory" in one_error_line(err)
    manifest = tmp_path / "manifest"
    manifest.write_text("ok/file\n\n/etc/passwd\n")
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest))
    assert code == cli.EXIT_USAGE
    assert f"{manifest}:3: /etc/passwd is not inside {env.mnt}" in one_error_line(err)
    manifest.write_text("../escape\n")
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest))
    assert f"{manifest}:1: ../escape is not inside" in one_error_line(err)
    assert env.fake.calls == []


def test_stage_in_progress_on_a_terminal(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env.fake.handlers = {"stage_in": lambda a: {"ticket": 7},
                         "progress": progress_script([step(2, 2 << 20), step(0, 0, True)])}
    env.start()
    monkeypatch.setattr(cmd_stage_in, "stderr_is_terminal", lambda: True)
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt))
    assert (code, out) == (0, "")
    assert "\rstaging in: 1/3 files, 2.0 MiB/3.0 MiB left" in err


def test_flush_daemon_dies_while_waiting(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    def progress(args: dict[str, Any]) -> dict[str, Any]:
        assert env.daemon is not None
        threading.Thread(target=env.daemon.stop).start()  # from outside its trio run
        return step(3, 3 << 20)

    env.fake.handlers = {"flush": lambda a: {"ticket": 7}, "progress": progress}
    env.start()
    code, out, err = run_cli(capsys, "flush", str(env.mnt), "--wait")
    assert code == cli.EXIT_FAILED and out == ""
    assert f"lost the connection to the daemon of {env.mnt}" in one_error_line(err)


# -- stage-out -----------------------------------------------------------------------------


def make_tree(top: Path) -> None:
    (top / "d" / "e").mkdir(parents=True)
    (top / "big.bin").write_bytes(os.urandom(3 << 20))
    (top / "d" / "small.txt").write_text("hello\n")
    (top / "d" / "e" / "empty").write_bytes(b"")
    (top / "d" / "script.sh").write_text("#!/bin/sh\n")
    os.chmod(top / "d" / "script.sh", 0o750)
    os.chmod(top / "d" / "e", 0o701)
    (top / "link").symlink_to("d/small.txt")
    (top / "dangling").symlink_to("nowhere")
    os.link(top / "d" / "small.txt", top / "hard")
    os.mkfifo(top / "fifo")
    os.chown(top / "d" / "small.txt", 1234, 5678)
    os.utime(top / "big.bin", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    os.utime(top / "d", (1_500_000_000, 1_500_000_000))


def tree_state(top: Path) -> dict[str, tuple[Any, ...]]:
    """What a stage-out must keep: type, mode, owner, mtime (us), content or link target."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in ["", *dirnames, *filenames]:
            p = Path(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                what: Any = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(p)
            else:
                what = None
            key = str(p.relative_to(top))
            mtime = None if stat.S_ISDIR(st.st_mode) and name == "" else st.st_mtime_ns // 1000
            out[key] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                        mtime if not stat.S_ISLNK(st.st_mode) else None, what)
    return out


@pytest.fixture
def stage_out_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real_table = mounts.mount_table
    monkeypatch.setattr(mounts, "mount_table",
                        lambda: [*real_table(), MountEntry("memfs", str(mnt), "fuse.memfs")])
    return mnt


@pytest.mark.skipif(os.geteuid() != 0, reason="chown in the tree needs root")
def test_stage_out_writes_one_faithful_archive(
    stage_out_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mnt = stage_out_env
    tree = mnt / "job" / "results"
    tree.mkdir(parents=True)
    make_tree(tree)
    out_dir = tmp_path / "backing"
    out_dir.mkdir()
    archive = out_dir / "out.tar"
    archive.write_bytes(b"an older archive")
    code, out, err = run_cli(capsys, "stage-out", str(tree), "--archive", str(archive))
    assert (code, out, err) == (0, "", "")
    assert os.getxattr(tree, common.FLUSH_XATTR) == b"off"
    assert sorted(os.listdir(out_dir)) == ["out.tar"]  # no temporary left over
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert all(m.name == "results" or m.name.startswith("results/") for m in members.values())
        assert tar.getmembers()[0].name == "results"
        assert members["results/hard"].islnk() and members["results/hard"].linkname == "results/d/small.txt"
        assert members["results/link"].issym() and members["results/link"].linkname == "d/small.txt"
        assert members["results/fifo"].isfifo()
        assert members["results/big.bin"].mtime == pytest.approx(1_600_000_000.123457, abs=1e-6)
        assert members["results/big.bin"].pax_headers["mtime"] == "1600000000.123456789"
    # GNU tar restores it as it was (modes, owners, mtimes, links, content).
    if shutil.which("tar") is None:
        pytest.skip("no tar to extract with")
    restored = tmp_path / "restored"
    restored.mkdir()
    subprocess.run(["tar", "-C", str(restored), "-xpf", str(archive)], check=True)
    want = tree_state(tree)
    got = tree_state(restored / "results")
    assert got == want
    assert os.lstat(restored / "results" / "hard").st_ino == os.lstat(restored / "results" / "d" / "small.txt").st_ino


def test_stage_out_progress_on_a_terminal(
    stage_out_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = stage_out_env / "t"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f").write_bytes(b"x" * (2 << 20))
    (tree / "g").write_bytes(b"y" * 100)
    monkeypatch.setattr(cmd_stage_out, "stderr_is_terminal", lambda: True)
    code, out, err = run_cli(capsys, "stage-out", str(tree), "--archive", str(tmp_path / "t.tar"))
    assert (code, out) == (0, "")
    assert "\rstage-out: 2/2 files, 0 B/2.0 MiB left" in err, repr(err)
    assert err.endswith("\r\x1b[K")
    with tarfile.open(tmp_path / "t.tar") as tar:
        assert tar.getnames() == ["t", "t/a", "t/a/f", "t/g"]
        f = tar.extractfile("t/a/f")
        assert f is not None and f.read() == b"x" * (2 << 20)


def test_stage_out_failure_leaves_no_torn_archive(
    stage_out_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = stage_out_env / "t"
    tree.mkdir()
    (tree / "f").write_bytes(b"z" * 100_000)
    archive = tmp_path / "out.tar"
    archive.write_bytes(b"the previous archive")

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    code, out, err = run_cli(capsys, "stage-out", str(tree), "--archive", str(archive))
    assert code == cli.EXIT_FAILED and out == ""
    assert "No space left on device; no archive written" in one_error_line(err)
    assert archive.read_bytes() == b"the previous archive"
    assert sorted(os.listdir(tmp_path)) == ["mnt", "out.tar"]


def test_stage_out_mistakes(
    stage_out_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mnt = stage_out_env
    (mnt / "t").mkdir()
    (mnt / "ln").symlink_to("t")
    (tmp_path / "elsewhere").mkdir()
    cases = {
        (str(tmp_path / "elsewhere"), str(tmp_path / "a.tar")): "is not inside a memfs mount",
        (str(mnt / "none"), str(tmp_path / "a.tar")): "does not exist",
        (str(mnt / "ln"), str(tmp_path / "a.tar")): "is a symbolic link",
        (str(mnt / "t"), str(mnt / "a.tar")): f"is inside the memfs mount {mnt}",
        (str(mnt / "t"), str(tmp_path / "no" / "a.tar")): "for the archive does not exist",
        (str(mnt / "t"), str(tmp_path / "elsewhere")): "is a directory",
    }
    for (path, archive), mentions in cases.items():
        code, out, err = run_cli(capsys, "stage-out", path, "--archive", archive)
        assert code == cli.EXIT_USAGE and out == ""
        assert mentions in one_error_line(err), (path, archive, err)
    with pytest.raises(OSError):  # refused before the tree was touched
        os.getxattr(mnt / "t", common.FLUSH_XATTR)


# -- umount: waiting for a daemon that drains -----------------------------------------------


def test_umount_waits_for_a_draining_daemon(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told once what is being written back (after ~2 s), then waits until the daemon is gone."""
    monkeypatch.setattr(cmd_umount, "DRAIN_NOTICE_AFTER", 0.3)
    start = time.monotonic()

    def status(args: dict[str, Any]) -> dict[str, Any]:
        elapsed = time.monotonic() - start
        if elapsed > 1.0:
            assert env.daemon is not None
            threading.Thread(target=env.daemon.stop).start()  # the daemon exits when done
        left = 3 if elapsed < 1.0 else 1
        return {**STATUS, "dirty_files": left, "dirty_bytes": left << 20, "draining": True}

    env.fake.handlers = {"status": status}
    env.start()
    client = ControlClient(env.sock, str(env.mnt), timeout=2)
    client.connect()
    cmd_umount.wait_for_daemon(str(env.mnt), None, client)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert 1.0 < elapsed < 5, elapsed
    assert err == "memfs: writing back 3 MiB (3 files) to /lustre/job42 before exit...\n"
    assert out == ""


def test_umount_wait_without_a_backing_directory(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon that answers ENOTSUP: wait for its pid only, say nothing."""
    env.fake.handlers = {"status": raises(
        FsError(errno.ENOTSUP, "this filesystem has no backing directory (--backing)"))}
    env.start()
    with subprocess.Popen(["sleep", "0.5"]) as proc:
        client = ControlClient(env.sock, str(env.mnt), timeout=2)
        client.connect()
        start = time.monotonic()
        reaper = threading.Thread(target=proc.wait)
        reaper.start()
        cmd_umount.wait_for_daemon(str(env.mnt), proc.pid, client)
        assert time.monotonic() - start > 0.3
        reaper.join()
    assert capsys.readouterr() == ("", "")


def test_progress_text() -> None:
    p = {"files": 328, "bytes": int(1.2 * (1 << 30)), "total_files": 340, "total_bytes": 4 << 30}
    assert progress_text("flushing", TicketProgress.from_json(p), 0.5) == "flushing: 12/340 files, 1.2 GiB/4.0 GiB left"
    assert progress_text("flushing", TicketProgress.from_json(p), 10) == \
        "flushing: 12/340 files, 1.2 GiB/4.0 GiB left, 286.7 MiB/s"
    assert common.format_bytes(0) == "0 B" and common.format_bytes(1023) == "1023 B"
    assert common.format_bytes(1536) == "1.5 KiB"


def test_json_reply_is_one_line_even_with_newlines_in_strings(sock_path: str) -> None:
    """Paths may hold newlines; the framing must not break on them."""
    fake = FakeMeta({"echo": echo})
    daemon = DaemonThread(sock_path, fake)
    try:
        with ControlClient(sock_path, "/m") as c:
            assert c.call("echo", {"p": "a\nb"}) == {"echo": {"p": "a\nb"}}
            assert c.call("echo", {"p": "\udcff"}) == {"echo": {"p": "\udcff"}}  # surrogateescape
    finally:
        daemon.stop()



# -- rough edges found by a new user --------------------------------------------------------


def test_stage_in_reports_files_that_could_not_be_fetched(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files whose fetch from the backing directory failed count as done for the
    daemon; the command says which (ten, then how many more) and exits 1, so a
    Slurm prolog does not start the job without them."""
    failed = [{"path": f"in/f{i:02d}", "error": "[Errno 2] No such file or directory"}
              for i in range(13)]
    env.fake.handlers = {
        "stage_in": lambda a: {"ticket": 7},
        "progress": progress_script([step(2, 2 << 20), {**step(0, 0, True), "failed": failed}]),
        "status": lambda a: STATUS,
    }
    env.start()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt))
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert err.splitlines() == [
        f"memfs: error: stage-in of {env.mnt}/in/f{i:02d}: [Errno 2] No such file or directory"
        for i in range(10)
    ] + ["memfs: error: ... and 3 more"]
    env.fake.handlers["progress"] = lambda a: {**step(0, 0, True), "failed": failed[:1]}
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt))
    assert code == cli.EXIT_FAILED
    assert err == f"memfs: error: stage-in of {env.mnt}/in/f00: [Errno 2] No such file or directory\n"


def test_stage_in_larger_than_the_pool_warns(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    total = (4 << 30) + (300 << 20)
    env.fake.handlers = {
        "stage_in": lambda a: {"ticket": 7},
        "progress": lambda a: {**step(0, 0, True), "total_bytes": total},
        "status": lambda a: STATUS,  # a pool of 4 GiB
    }
    env.start()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt))
    assert (code, out) == (0, "")
    assert err == ("memfs: warning: staged 4396 MiB into a pool of 4096 MiB: only the most "
                   "recently staged part stays in memory\n")
    env.fake.handlers["progress"] = lambda a: {**step(0, 0, True), "total_bytes": 4 << 30}
    assert run_cli(capsys, "stage-in", str(env.mnt)) == (0, "", "")


def test_options_after_paths(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    (env.mnt / "a").mkdir()
    (env.mnt / "b").mkdir()
    env.fake.handlers = {"flush": lambda a: {"ticket": 7}, "stage_in": lambda a: {"ticket": 7},
                         "progress": lambda a: step(0, 0, True), "status": lambda a: STATUS}
    env.start()
    code, out, err = run_cli(capsys, "flush", str(env.mnt), str(env.mnt / "a"), "--wait",
                             str(env.mnt / "b"), "-q")
    assert (code, out, err) == (0, "", "")
    assert env.fake.calls[:2] == [("flush", {"paths": ["a", "b"]}), ("progress", {"ticket": 7})]
    env.fake.calls.clear()
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--no-wait", str(env.mnt / "a"))
    assert code == 0 and out.startswith("staging in") and err == ""
    assert env.fake.calls[0] == ("stage_in", {"paths": ["a"]})


def test_paths_that_do_not_exist(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped PATH is a usage error naming the full path, before the daemon is asked;
    a relative PATH is looked for in the working directory, then at the mount root."""
    (env.mnt / "inputs").mkdir()
    env.fake.handlers = {"flush": lambda a: {"ticket": 7}, "stage_in": lambda a: {"ticket": 7},
                         "progress": lambda a: step(0, 0, True), "status": lambda a: STATUS}
    env.start()
    monkeypatch.chdir(env.mnt / "inputs")
    for cmd in ("flush", "stage-in"):
        for path, full in (("nope", env.mnt / "inputs" / "nope"),
                           (str(env.mnt / "typo"), env.mnt / "typo"),
                           ("../inputs/x/y", env.mnt / "inputs" / "x" / "y")):
            code, out, err = run_cli(capsys, cmd, str(env.mnt), path)
            assert (code, out) == (cli.EXIT_USAGE, "")
            assert one_error_line(err) == f"memfs: error: {full} does not exist"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "inputs/mesh")
    assert one_error_line(err) == f"memfs: error: {env.mnt}/inputs/mesh does not exist"
    assert env.fake.calls == []
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "inputs", "--no-wait")
    assert code == 0 and env.fake.calls[0] == ("stage_in", {"paths": ["inputs"]})
    (tmp_path / "elsewhere" / "inputs").mkdir()  # now it means the one here: outside
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "inputs")
    assert one_error_line(err) == f"memfs: error: inputs is not inside {env.mnt}"


def test_manifest_names_missing_in_the_mount_are_usage_errors(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env.fake.handlers = {"stage_in": raises(FsError(errno.ENOENT, "in/x: No such file or directory"))}
    env.start()
    manifest = tmp_path / "m"
    manifest.write_text("in/x\n")
    code, out, err = run_cli(capsys, "stage-in", str(env.mnt), "--manifest", str(manifest))
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert one_error_line(err) == f"memfs: error: in {env.mnt}: in/x: No such file or directory"


def test_usage_without_arguments_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``memfs flush`` alone names what is missing (not an optional PATH); --help
    shows no reStructuredText markup."""
    for cmd in ("flush", "stage-in", "status"):
        with pytest.raises(SystemExit) as info:
            cli.main([cmd])
        assert info.value.code == cli.EXIT_USAGE
        out, err = capsys.readouterr()
        assert err.splitlines()[-1] == f"memfs {cmd}: error: the following arguments are required: MNT"
        assert f"usage: memfs {cmd} " in err and "MNT" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out, err = capsys.readouterr()
    assert "``" not in out and "FUSE filesystem over pooled memory" in out


def test_stage_out_of_the_mount_root_is_refused(
    stage_out_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It would exclude the whole filesystem from write-back."""
    mnt = stage_out_env
    (mnt / "sub").mkdir()
    for path in (str(mnt), str(mnt) + "/", str(mnt / "sub" / "..")):
        code, out, err = run_cli(capsys, "stage-out", path, "--archive", str(tmp_path / "a.tar"))
        assert (code, out) == (cli.EXIT_USAGE, "")
        assert "is the root of the memfs mount" in one_error_line(err)
    with pytest.raises(OSError):
        os.getxattr(mnt, common.FLUSH_XATTR)
    assert not (tmp_path / "a.tar").exists()


def test_umount_shows_why_write_back_keeps_failing(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal, while the daemon drains: each new write-back error once,
    newest first; errors from before the unmount (older than a minute) are history."""
    monkeypatch.setattr(cmd_umount, "DRAIN_NOTICE_AFTER", 0.1)
    monkeypatch.setattr(cmd_umount, "stderr_is_terminal", lambda: True)
    now = time.time()
    old = {"path": "old.dat", "error": "[Errno 13] Permission denied", "count": 1, "last": now - 3600}
    full = {"path": "out/a.dat", "error": "[Errno 28] No space left on device", "count": 1,
            "last": now - 1}
    calls = [0]

    def status(args: dict[str, Any]) -> dict[str, Any]:
        calls[0] += 1
        if calls[0] > 30:
            assert env.daemon is not None
            threading.Thread(target=env.daemon.stop).start()
        errors = [old, full] if calls[0] < 15 else [old, full, {**full, "count": 2, "last": now}]
        return {**STATUS, "dirty_files": 1, "dirty_bytes": 1 << 20, "draining": True,
                "errors": errors}

    env.fake.handlers = {"status": status}
    env.start()
    client = ControlClient(env.sock, str(env.mnt), timeout=2)
    client.connect()
    cmd_umount.wait_for_daemon(str(env.mnt), None, client)
    out, err = capsys.readouterr()
    note = "memfs: write-back of out/a.dat: [Errno 28] No space left on device (retrying)\n"
    assert err.count(note) == 2, err
    assert "old.dat" not in err
    assert "\rwriting back: 1 files, 1.0 MiB left" in err


def test_a_refused_peer_is_told_who_may(sock_path: str) -> None:
    server = RawServer(sock_path, b'{"error": "uid 1000 may not ...", "errno": 13, "owner": 4242}\n')
    try:
        with ControlClient(sock_path, "/mnt/job", timeout=2) as c:
            with pytest.raises(UsageError) as info:
                c.call("status")
        assert str(info.value) == ("only root and the owner of /mnt/job (uid 4242) may control "
                                   f"this mount (you are uid {os.getuid()})")
    finally:
        server.close()
