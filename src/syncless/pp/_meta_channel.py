"""Step metadata between two neighbouring stages of one node, over a Unix stream socket.

The copy-engine transport only runs within one node, so each link's metadata
(the step number and the row counts, ``1 + n`` int64) goes through a local
socket rather than the gloo group:

* a send or a receive is one system call of a few microseconds (a gloo
  ``isend``/``irecv`` pair cost tens of microseconds of host CPU per step);
* a receiver that waits is blocked in the kernel and burns no CPU;
* a peer that dies closes its end, so a waiting receiver learns it at once
  instead of at the timeout.

Set-up, collective over the stages (driven by ``_copy_engine``): the receiving
stage creates a :class:`Listener` (an abstract-namespace name, nothing on the
file system), the name travels in the set-up exchange, the sending stage
calls :func:`connect`, and the receiving stage :meth:`Listener.accept`\\ s.
Every call here blocks the host (for at most its timeout); none touches the
GPU. Plain Python over sockets, so it is unit-tested on the CPU.
"""

from __future__ import annotations

import os
import socket
import struct
import uuid

from syncless._core.errors import PeerTimeoutError

_NAME_PREFIX = "syncless-pp"


def _message_format(length: int) -> struct.Struct:
    if length < 1:
        raise ValueError(f"a metadata message holds at least the step number; got length {length}")
    return struct.Struct(f"<{length}q")


class Listener:
    """The receiving end before the sender connected: a listening socket with a unique abstract name."""

    def __init__(self) -> None:
        self.name = f"\0{_NAME_PREFIX}-{os.getpid()}-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(1)
        except OSError:
            self._sock.close()
            raise

    def accept(self, length: int, timeout_s: float, what: str) -> Receiver:
        """Wait (at most ``timeout_s``) for the sender's connection; return the receiving end.

        Raises:
            PeerTimeoutError: the sender did not connect in time.
        """
        self._sock.settimeout(timeout_s)
        try:
            conn, _ = self._sock.accept()
        except OSError as err:  # socket.timeout is an OSError
            raise PeerTimeoutError(f"{what}: the previous stage did not connect within {timeout_s:g} s: {err}") from err
        return Receiver(conn, length)

    def close(self) -> None:
        self._sock.close()


def connect(name: str, length: int, timeout_s: float, what: str) -> Sender:
    """Connect to a :class:`Listener` of this node by its name; return the sending end.

    Raises:
        PeerTimeoutError: nobody listens under ``name`` (or not in time).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(name)
    except OSError as err:
        sock.close()
        raise PeerTimeoutError(f"{what}: could not reach the next stage's metadata socket: {err}") from err
    return Sender(sock, length)


class Sender:
    """Sends ``[step, *rows]`` messages of a fixed length; one per step, in order."""

    def __init__(self, sock: socket.socket, length: int):
        self._sock = sock
        self._format = _message_format(length)
        self._buffer = bytearray(self._format.size)

    def send(self, step: int, rows: list[int], timeout_s: float) -> None:
        """Queue one message (blocks only while the peer's socket buffer is full, at most ``timeout_s``).

        Raises:
            PeerTimeoutError: the next stage stopped reading for ``timeout_s`` or closed its end.
        """
        self._format.pack_into(self._buffer, 0, step, *rows)
        try:
            self._sock.sendall(self._buffer)
        except OSError as err:
            raise PeerTimeoutError(
                f"the next stage took no metadata for {timeout_s:g} s or closed its end "
                f"(it may have died): {err}"
            ) from err

    def settimeout(self, timeout_s: float) -> None:
        self._sock.settimeout(timeout_s)

    def close(self) -> None:
        self._sock.close()


class Receiver:
    """Receives the fixed-length messages a :class:`Sender` sends, into one reused buffer."""

    def __init__(self, sock: socket.socket, length: int):
        self._sock = sock
        self._format = _message_format(length)
        self._buffer = bytearray(self._format.size)
        self._view = memoryview(self._buffer)

    def recv(self, timeout_s: float, what: str) -> tuple[int, ...]:
        """Block until the next message is complete (at most ``timeout_s`` without progress); return it.

        Raises:
            PeerTimeoutError: nothing (or only part of a message) came in time, or the sender closed its
                end (it died or closed the transport early).
        """
        self._sock.settimeout(timeout_s)
        view, size, got = self._view, self._format.size, 0
        while got < size:
            try:
                count = self._sock.recv_into(view[got:], size - got)
            except OSError as err:
                raise PeerTimeoutError(
                    f"{what}: the previous stage sent nothing within {timeout_s:g} s (it may have died or "
                    f"stopped sending; raise SYNCLESS_PP_TIMEOUT_S if it is only slow): {err}"
                ) from err
            if count == 0:
                raise PeerTimeoutError(
                    f"{what}: the previous stage closed its metadata socket (it died or closed the transport)"
                )
            got += count
        return self._format.unpack_from(self._buffer)

    def close(self) -> None:
        self._sock.close()
