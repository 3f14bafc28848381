"""Socket set-up shared by the metadata and memory-server protocols.

Both drive non-blocking stdlib sockets directly from trio (see
:mod:`memfs.transport.sockio` and :mod:`memfs.meta.conn` for why); connecting,
listening, accepting and closing are the same for both.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import trio
import trio.lowlevel

log = logging.getLogger(__name__)


def close_socket(sock: socket.socket) -> None:
    """Close *sock*, waking any task waiting on it (with ``ClosedResourceError``)."""
    if sock.fileno() >= 0:
        trio.lowlevel.notify_closing(sock)
        sock.close()


async def accept_connections(
    listener: socket.socket, serve: Callable[[socket.socket, tuple[Any, ...]], object]
) -> None:
    """Accept on non-blocking *listener* until cancelled, handing each connection
    and its peer address to *serve* (which starts a task for it).  Out of
    descriptors or buffers (EMFILE and friends): log, let the pressure pass, retry."""
    while True:
        try:
            sock, addr = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        except OSError as exc:
            log.error("accept failed: %s", exc)
            await trio.sleep(0.1)
            continue
        serve(sock, addr)
        await trio.lowlevel.checkpoint()


async def connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket with TCP_NODELAY (requests are small frames)."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            try:
                sock.connect(addr)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, f"connect to {host}:{port}: {os.strerror(err)}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            close_socket(sock)
            error = exc
        except BaseException:
            close_socket(sock)
            raise
    raise error


def listen(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Non-blocking listening sockets for *host*:*port* (one address when *port* is 0)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
            if port == 0:
                break  # every socket would get a different port
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def set_keepalive(sock: socket.socket) -> None:
    """Notice a vanished peer on an otherwise silent connection (about 2 min): a
    memory server's connections hold what their peer holds (an RDMA queue pair,
    volume claims), which must go when a host dies without a word."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6)
    except OSError as exc:  # pragma: no cover - Linux has them all
        log.debug("TCP keepalive: %s", exc)
