"""What one connection's socket says, read from its file descriptor: the liveness checks of
:mod:`rlactors.wire.transport` (when its peer was last heard, whether the peer read what was sent,
the bytes received) and the hang-up that cuts a silent one, all on a duplicate of the socket that
libzmq owns, checked to be the same one (its inode) before use."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios

__all__ = ["Peer", "inode"]


class Peer:
    """One connection, for liveness: its socket (fd and inode, so that a later look finds the same
    one: -1 unknown), when its peer was last heard (awake time), whether the peer pings (a ROUTER
    pings those back), and the bytes received on it at the last look (TCP)."""

    __slots__ = ("fd", "heard", "inode", "pings", "rx")

    def __init__(self, fd: int | tuple[int, int], heard: float) -> None:
        self.fd, self.inode = fd if isinstance(fd, tuple) else (fd, inode(fd))
        self.heard, self.pings, self.rx = heard, False, -1

    def _socket(self) -> socket.socket | None:
        """A duplicate of the connection's socket, if it is still the one noted."""
        if self.fd < 0:
            return None
        try:
            fd = os.dup(self.fd)  # checked after the dup: what is checked is what is used
        except OSError:
            return None
        try:
            if os.fstat(fd).st_ino == self.inode:  # else closed since, and the number reused
                return socket.socket(fileno=fd)
        except OSError:
            pass
        os.close(fd)
        return None

    def received(self) -> int | None:
        """Bytes received on the connection (TCP's tcpi_bytes_received), None if not TCP."""
        sock = self._socket()
        if sock is None:
            return None
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            return int(struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0]) if len(info) >= 136 else None
        except OSError:
            return None
        finally:
            sock.close()

    def read_all(self) -> bool:
        """Whether the peer, in this host, has read every byte sent to it: over ipc, nothing is
        left in our socket's send queue (SIOCOUTQ counts what the peer has not read); over TCP on
        this host, the peer's socket (found in /proc/net/tcp) has nothing left to read. False
        when unknown (a peer on another host: its kernel's acknowledgements say nothing of it)."""
        sock = self._socket()
        if sock is None:
            return False
        try:
            if sock.family == socket.AF_UNIX:
                return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0] == 0
            if sock.family == socket.AF_INET:
                return _peer_rx_queue(sock.getpeername(), sock.getsockname()) == 0
            return False
        except OSError:
            return False
        finally:
            sock.close()

    def hang_up(self) -> bool:
        """Shut the connection down: libzmq reads the end of it and disconnects (a DEALER then
        reconnects), as after a ZMTP heartbeat timed out. False if it was already gone."""
        sock = self._socket()
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            sock.close()
        return True


_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in Linux's struct tcp_info (since 4.1)


def _peer_rx_queue(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """Bytes waiting to be read in the socket at ``local`` connected from ``remote``, if it is in
    this host's network namespace (/proc/net/tcp); None if it is not."""

    def hexed(addr: tuple[str, int]) -> str:
        return f"{struct.unpack('<I', socket.inet_aton(addr[0]))[0]:08X}:{addr[1]:04X}"

    want = f"{hexed(local)} {hexed(remote)}"
    with open("/proc/net/tcp") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) > 4 and f"{fields[1]} {fields[2]}" == want:
                return int(fields[4].split(":")[1], 16)
    return None


def inode(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino if fd >= 0 else -1
    except OSError:
        return -1
