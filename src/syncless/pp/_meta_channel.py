"""Step metadata between two neighbouring stages of one node, over a Unix stream socket.

The copy-engine transport only runs within one node, so each link's metadata
(the step number and the row counts, ``1 + n`` int64) goes through a local
socket rather than the gloo group:

* a send or a receive is two or three system calls, a few microseconds (a
  gloo ``isend``/``irecv`` pair cost tens of microseconds of host CPU per step);
* a receiver that waits is blocked in the kernel and burns no CPU;
* a peer that dies closes its end, so a waiting receiver learns it at once
  instead of at the timeout.

Set-up, collective over the stages (driven by ``_copy_engine_setup``): the
receiving stage creates a :class:`Listener` (an abstract-namespace name,
nothing on the file system, and a random token), name and token travel in the
set-up exchange over the private gloo group (set-up step 2), the sending stage calls :func:`connect`
(which sends the token first), and the receiving stage
:meth:`Listener.accept`\\ s the connection that presents the token; any
other local process that connects to the name is turned away. Abstract
names live in the network namespace: stages in separate network namespaces
(containers that share the GPUs but not the network) cannot connect, and
``make_transport`` falls back to torch.distributed there.
Every call here blocks the host (for at most its timeout); none touches the
GPU. Plain Python over sockets, so it is unit-tested on the CPU.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import time
import uuid

from syncless._core.errors import PeerTimeoutError

_NAME_PREFIX = "syncless-pp"
TOKEN_NBYTES = 16


def _message_format(length: int) -> struct.Struct:
    if length < 1:
        raise ValueError(f"a metadata message holds at least the step number; got length {length}")
    return struct.Struct(f"<{length}q")


class Listener:
    """The receiving end before the sender connected: a listening socket with a unique abstract name."""

    def __init__(self) -> None:
        self.name = f"\0{_NAME_PREFIX}-{os.getpid()}-{uuid.uuid4().hex}"
        self.token = os.urandom(TOKEN_NBYTES)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(1)
        except OSError:
            self._sock.close()
            raise

    def accept(self, length: int, timeout_s: float, what: str) -> Receiver:
        """Wait (at most ``timeout_s``) for the sender's connection, the one that presents the token.

        Connections without the token are closed and the wait goes on.

        Raises:
            PeerTimeoutError: the sender did not connect in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError("timed out")
                self._sock.settimeout(left)
                conn, _ = self._sock.accept()
            except OSError as err:  # socket.timeout is an OSError
                raise PeerTimeoutError(
                    f"{what}: the previous stage did not connect within {timeout_s:g} s: {err}"
                ) from err
            if self._presents_token(conn, max(deadline - time.monotonic(), 0.001)):
                return Receiver(conn, length, timeout_s)
            conn.close()

    def _presents_token(self, conn: socket.socket, timeout_s: float) -> bool:
        conn.settimeout(timeout_s)
        got = b""
        try:
            while len(got) < TOKEN_NBYTES:
                chunk = conn.recv(TOKEN_NBYTES - len(got))
                if not chunk:
                    return False
                got += chunk
        except OSError:
            return False
        return hmac.compare_digest(got, self.token)

    def close(self) -> None:
        self._sock.close()


def connect(name: str, token: bytes, length: int, timeout_s: float, what: str) -> Sender:
    """Connect to a :class:`Listener` of this node by its name and present its token; return the sending end.

    Raises:
        PeerTimeoutError: nobody listens under ``name`` (or not in time).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(name)
        sock.sendall(token, socket.MSG_NOSIGNAL)
    except OSError as err:
        sock.close()
        raise PeerTimeoutError(f"{what}: could not reach the next stage's metadata socket: {err}") from err
    return Sender(sock, length, timeout_s)


class _Endpoint:
    """One connected end: the socket with its timeout, and a buffer for one fixed-length message."""

    def __init__(self, sock: socket.socket, length: int, timeout_s: float):
        self._sock = sock
        self._sock.settimeout(timeout_s)
        self._timeout_s = timeout_s
        self._format = _message_format(length)
        self._buffer = bytearray(self._format.size)

    def close(self) -> None:
        self._sock.close()


class Sender(_Endpoint):
    """Sends ``[step, *rows]`` messages of a fixed length; one per step, in order.

    A send blocks only while the receiver's socket buffer is full (a few
    hundred messages unread), at most ``timeout_s``.
    """

    def send(self, step: int, rows: list[int]) -> None:
        """Queue one message.

        Raises:
            PeerTimeoutError: the next stage stopped reading for the timeout or closed its end. (No
                SIGPIPE: a closed peer is an error here, never a signal that ends the process.)
        """
        self._format.pack_into(self._buffer, 0, step, *rows)
        try:
            self._sock.sendall(self._buffer, socket.MSG_NOSIGNAL)
        except OSError as err:
            raise PeerTimeoutError(
                f"the next stage took no metadata for {self._timeout_s:g} s or closed its end "
                f"(it may have died): {err}"
            ) from err


class Receiver(_Endpoint):
    """Receives the fixed-length messages a :class:`Sender` sends, into one reused buffer."""

    def __init__(self, sock: socket.socket, length: int, timeout_s: float):
        super().__init__(sock, length, timeout_s)
        self._view = memoryview(self._buffer)

    def recv(self, timeout_s: float, what: str) -> tuple[int, ...]:
        """Block until the next message is complete (at most ``timeout_s`` without progress); return it.

        Raises:
            PeerTimeoutError: nothing (or only part of a message) came in time, or the sender closed its
                end (it died or closed the transport early).
        """
        if timeout_s != self._timeout_s:
            self._sock.settimeout(timeout_s)
            self._timeout_s = timeout_s
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
