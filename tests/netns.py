"""Test hosts on one machine: network namespaces joined by a bridge.

``TestNet`` creates a "switch" namespace holding a bridge and one namespace per
host, each with a veth pair into the switch and an address in a private /24
that exists only inside these namespaces.  Nothing is configured in the
machine's own network namespace, and ``close()`` deletes every namespace (and
with them every veth and the bridge).

Processes join a host with ``nsenter --net=...`` (network only): a FUSE mount
made by a client "on" a host stays visible to the test, unlike with
``ip netns exec``, which also unshares the mount namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence

SUBNET = "10.213.{n}.{host}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} missing (apt-get install iproute2 util-linux)"
    probe = f"mfsprobe{uuid.uuid4().hex[:6]}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode:
        return f"cannot create network namespaces: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TestNet:
    """A bridged set of hosts; ``addr[name]`` is each host's IPv4 address."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: Sequence[str], subnet: int = 7) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"mfs{self.tag}sw"
        self.hosts = {h: f"mfs{self.tag}{h}" for h in hosts}
        self.addr: dict[str, str] = {}
        self._made: list[str] = []
        try:
            self._build(subnet)
        except BaseException:
            self.close()
            raise

    def _build(self, subnet: int) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["-n", self.switch]
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        _ip(*sw, "link", "set", "lo", "up")
        for i, (host, ns) in enumerate(self.hosts.items(), start=1):
            _ip("netns", "add", ns)
            self._made.append(ns)
            # Create the pair inside the host namespace, then move one end out.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            _ip("-n", ns, "link", "set", f"p{i}", "netns", self.switch)
            _ip(*sw, "link", "set", f"p{i}", "master", "br0")
            _ip(*sw, "link", "set", f"p{i}", "up")
            addr = SUBNET.format(n=subnet, host=i)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addr[host] = addr

    def cmd(self, host: str, argv: Sequence[str]) -> list[str]:
        """*argv* run with *host*'s network (and the machine's mounts)."""
        return ["nsenter", f"--net=/var/run/netns/{self.hosts[host]}", *argv]

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> TestNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
