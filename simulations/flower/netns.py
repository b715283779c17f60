"""Network namespaces as hosts for a deployment on one machine (needs root / CAP_SYS_ADMIN)."""

from __future__ import annotations

import secrets
import shutil
import subprocess

__all__ = ["NamespaceError", "Namespaces"]


class NamespaceError(RuntimeError):
    """An ``ip`` command creating the namespaces failed."""


class Namespaces:
    """Network namespaces as hosts: ``server`` holds a bridge with 10.231.0.1/24, host i a veth
    into it with 10.231.0.(10 + i). All created here; ``delete()`` removes them all."""

    SUBNET = "10.231.0"

    def __init__(self, num_clients: int) -> None:
        tag = secrets.token_hex(3)
        self.tag = tag
        self.server = f"celgc-{tag}-srv"
        self.clients = [f"celgc-{tag}-c{i}" for i in range(num_clients)]
        self.server_ip = f"{self.SUBNET}.1"
        self._created: list[str] = []

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why namespaces cannot be created here (None: they can)."""
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        name = f"celgc-probe-{secrets.token_hex(3)}"
        probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            return f"`ip netns add` failed ({probe.stderr.strip() or probe.returncode}): needs root / CAP_SYS_ADMIN"
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        return None

    def client_ip(self, i: int) -> str:
        return f"{self.SUBNET}.{10 + i}"

    def client_ifname(self, i: int) -> str:
        """Host i's end of its veth (inside its namespace): the interface to name in
        GLOO_SOCKET_IFNAME and the like, since a hostname resolves alike in every namespace."""
        return f"cg{self.tag}h{i}"

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = [*(self.prefix(ns) if ns else []), "ip", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            raise NamespaceError(f"{' '.join(cmd)}: {res.stderr.strip()}")

    def create(self) -> Namespaces:
        for ns in [self.server, *self.clients]:
            self._ip("netns", "add", ns)
            self._created.append(ns)
            self._ip("link", "set", "lo", "up", ns=ns)
        self._ip("link", "add", "br0", "type", "bridge", ns=self.server)
        self._ip("addr", "add", f"{self.server_ip}/24", "dev", "br0", ns=self.server)
        self._ip("link", "set", "br0", "up", ns=self.server)
        for i, ns in enumerate(self.clients):
            host_end, link_end = self.client_ifname(i), f"cg{self.tag}l{i}"  # <= 15 characters
            self._ip("link", "add", host_end, "type", "veth", "peer", "name", link_end)
            self._ip("link", "set", link_end, "netns", self.server)
            self._ip("link", "set", host_end, "netns", ns)
            self._ip("link", "set", link_end, "master", "br0", ns=self.server)
            self._ip("link", "set", link_end, "up", ns=self.server)
            self._ip("addr", "add", f"{self.client_ip(i)}/24", "dev", host_end, ns=ns)
            self._ip("link", "set", host_end, "up", ns=ns)
        return self

    def delete(self) -> None:
        """Delete every namespace made here (their veths and the bridge go with them)."""
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._created.clear()

    def __enter__(self) -> Namespaces:
        try:
            return self.create()
        except BaseException:
            self.delete()
            raise

    def __exit__(self, *exc: object) -> None:
        self.delete()
