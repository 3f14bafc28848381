"""Prometheus metrics: ``--metrics HOST:PORT`` on the mount daemon, ``memfs mds`` and
``memfs memd``.

prometheus_client serves ``/metrics`` from its own HTTP thread.  Request
counters and latency histograms are updated where requests are served (they
are thread-safe); values that live in trio state (free space, dirty bytes,
sessions) are copied into gauges by a trio task every :data:`REFRESH` seconds,
because the HTTP thread must not touch trio objects.

Names: ``memfs_requests_total{op}``, ``memfs_request_errors_total{op,errno}``,
``memfs_request_seconds{op}`` (histogram), ``memfs_bytes_total{op}`` (memd),
``memfs_up{role}`` (``mount``, ``mds``, ``memd``), and per daemon the numbers
of its state: ``memfs_pool_bytes``, ``memfs_pool_free_bytes``, ``memfs_files``
(mount, mds), ``memfs_memory_server_up{server}`` (cluster mount),
``memfs_backing_*`` (the burst buffer's status), ``memfs_mds_*``, ``memfs_memd_*``.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from memfs.errors import UsageError

log = logging.getLogger(__name__)

#: seconds between copies of trio-side values into gauges
REFRESH = 2.0
#: latency buckets, seconds: FUSE requests take ~20 us to ~10 ms here
BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0)


class Metrics:
    """One daemon's registry, its request instruments and its refreshed gauges."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.requests = Counter("memfs_requests", "Requests served, by operation", ["op"],
                                registry=self.registry)
        self.errors = Counter("memfs_request_errors", "Requests answered with an error",
                              ["op", "errno"], registry=self.registry)
        self.latency = Histogram("memfs_request_seconds", "Time to serve a request", ["op"],
                                 buckets=BUCKETS, registry=self.registry)
        self.bytes = Counter("memfs_bytes", "Bytes moved by requests, by operation", ["op"],
                             registry=self.registry)
        up = Gauge("memfs_up", "1 while this daemon serves", ["role"], registry=self.registry)
        up.labels(role).set(1)
        self._gauges: dict[str, Gauge] = {}
        self._server: Any = None

    def observe(self, op: str, started: float, err: int | None = None) -> None:
        """A request of *op* that began at ``time.perf_counter()`` *started* is answered."""
        self.requests.labels(op).inc()
        self.latency.labels(op).observe(time.perf_counter() - started)
        if err is not None:
            self.errors.labels(op, errno.errorcode.get(err, str(err))).inc()

    def moved(self, op: str, nbytes: int) -> None:
        """A request of *op* moved *nbytes* of data."""
        self.bytes.labels(op).inc(nbytes)

    def set(self, values: dict[str, float]) -> None:
        """Gauges by name (created on first use)."""
        for name, value in values.items():
            g = self._gauges.get(name)
            if g is None:
                g = self._gauges[name] = Gauge(name, name.replace("_", " "), registry=self.registry)
            g.set(value)

    def set_labeled(self, name: str, label: str, values: dict[str, float]) -> None:
        """One gauge *name* with a sample per value of *label*."""
        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(name, name.replace("_", " "), [label],
                                           registry=self.registry)
        for key, value in values.items():
            g.labels(key).set(value)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on HOST:PORT from a thread; the bound port."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise UsageError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        bound = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    async def refresh(self, fill: Callable[[], Awaitable[dict[str, float]]]) -> None:
        """Copy what *fill* returns into gauges, every :data:`REFRESH` seconds, until
        cancelled; a failing *fill* is logged and tried again next time.  (*fill* may
        also call :meth:`set_labeled` itself.)"""
        while True:
            try:
                self.set(await fill())
            except Exception as exc:  # noqa: BLE001 - metrics must never stop the daemon
                log.warning("metrics: could not collect: %r", exc)
            await trio.sleep(REFRESH)
