"""Test hosts on one machine: network namespaces joined by a bridge (needs root and iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"rlxprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    """A bridge in the root namespace (the head's side) and one namespace per host."""

    tag: str
    subnet: str
    bridge: str
    names: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    def veth(self, i: int) -> str:
        return f"v{self.tag}{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def partition(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "up")

    def blackhole(self, i: int, ip: str) -> None:
        """Host ``i`` can no longer send to ``ip`` (a one-way partition); traffic to it still arrives."""
        sh(*self.exec_prefix(i), "ip", "route", "add", "blackhole", f"{ip}/32")

    def unblackhole(self, i: int, ip: str) -> None:
        sh(*self.exec_prefix(i), "ip", "route", "del", "blackhole", f"{ip}/32")

    def teardown(self) -> None:
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def make_hosts(n: int) -> Hosts:
    tag = uuid.uuid4().hex[:5]
    third = int(tag, 16) % 200 + 20
    hosts = Hosts(tag=tag, subnet=f"10.231.{third}", bridge=f"br{tag}")
    try:
        sh("ip", "link", "add", hosts.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{hosts.gateway}/24", "dev", hosts.bridge)
        sh("ip", "link", "set", hosts.bridge, "up")
        for i in range(n):
            name = f"rlx{tag}h{i}"
            sh("ip", "netns", "add", name)
            hosts.names.append(name)
            sh("ip", "link", "add", hosts.veth(i), "type", "veth", "peer", "name", f"e{tag}{i}")
            sh("ip", "link", "set", f"e{tag}{i}", "netns", name)
            sh("ip", "link", "set", hosts.veth(i), "master", hosts.bridge)
            sh("ip", "link", "set", hosts.veth(i), "up")
            sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", name, "ip", "link", "set", f"e{tag}{i}", "name", "eth0")
            sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{hosts.ip(i)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", name, "ip", "link", "set", "eth0", "up")
    except BaseException:  # any exit tears the namespaces down, then re-raises
        hosts.teardown()
        raise
    return hosts


def hosts_fixture(n: int) -> Any:
    """A module-scoped pytest fixture of ``n`` hosts, torn down after the module: in a test module,
    ``hosts = hosts_fixture(2)``."""

    @pytest.fixture(scope="module")
    def hosts() -> Iterator[Hosts]:
        h = make_hosts(n)
        try:
            yield h
        finally:
            h.teardown()

    return hosts


def skip_module_without_netns(why: str | None = None) -> None:
    """Skip the calling test module where network namespaces (or what ``why`` names) are missing."""
    why = netns_unavailable() or why
    if why:
        pytest.skip(f"namespaces unavailable: {why}", allow_module_level=True)
