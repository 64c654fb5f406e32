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
nothing on the file system, and a random secret token); name and token
travel in the set-up exchange over the private gloo group (set-up step 2);
the sending stage calls :func:`connect` (step 3) and the receiving stage
takes the authenticated connection with :meth:`Listener.accept` (step 4).
Abstract names live in the network namespace: stages in separate network
namespaces (containers that share the GPUs but not the network) cannot
connect, and ``make_transport`` falls back to torch.distributed there.

Other local processes (see ``docs/pp.md``, "Security"). Anyone on the node
can read the abstract name in ``/proc/net/unix`` and connect to it while the
listener is open (from set-up step 2 until the sender is authenticated;
abstract sockets have no file permissions). So:

* The listener drains its queue on a thread of its own from the moment it
  exists, so a flood of pending connections cannot fill the backlog and
  block the real sender's ``connect`` between set-up steps 2 and 4.
* A connection from another user (``SO_PEERCRED``: the effective uid the
  kernel recorded at ``connect``) is closed at once and logged.
* Every other connection gets a fresh 16-byte nonce and must answer, within
  :data:`HANDSHAKE_S`, with ``HMAC-SHA256(token, context | name | nonce)``.
  All pending connections are polled together: a silent one, one that sends
  garbage or a wrong answer, or one that hangs up, holds nothing up; it is
  dropped (at its own deadline at the latest) and logged.
* Replay: the answer is bound to the nonce of one connection, and a nonce
  is never reused (16 random bytes), so an answer captured from the real
  sender's connection is worthless on any other connection, and the token
  itself never crosses the socket. (A plain token, as before, could be
  replayed on a connection opened earlier than the real one.) The token is
  fresh per listener, so nothing from an earlier set-up is accepted either.
* The first correct answer wins: the listening socket is closed then (the
  name disappears, later connections are refused by the kernel) and every
  other pending connection is closed. From then on the metadata flows over
  one connected pair of sockets that no other process can write to or
  read from, so nothing a stranger does can delay a step.

Sockets are close-on-exec (Python's default) and closed in forked children
(``os.register_at_fork``): a child that kept a copy of a connected socket
would keep the connection open after this process died, and the peer would
wait for the timeout instead of seeing the closed end at once.

With ``depth="auto"`` the connection also carries one message the other way:
at the start of each recv(N) the receiving stage sends ``N`` ("posted",
:meth:`Receiver.post`), and the sending stage reads what has arrived at each
send without blocking (:meth:`Sender.read_posted`); ``_auto.PostedLog``
refuses any value out of order. It is the same authenticated pair of sockets,
so no other process can write into it.

Every call here blocks the host (for at most its timeout; ``read_posted``
never does); none touches the GPU. No pickles: the handshake is raw bytes, the steps fixed ``int64``
frames. Plain Python over sockets, so it is unit-tested on the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from syncless._core.errors import PeerTimeoutError

logger = logging.getLogger(__name__)

_NAME_PREFIX = "syncless-pp"
#: Bytes of the secret a listener hands out over the set-up exchange (an HMAC-SHA256 key).
TOKEN_NBYTES = 32
#: What the listener sends each new connection: a fixed greeting, then a fresh nonce.
GREETING = b"syncless-pp-meta/1\n"
NONCE_NBYTES = 16
CHALLENGE_NBYTES = len(GREETING) + NONCE_NBYTES
#: The answer: HMAC-SHA256 of context, name and nonce under the token.
ANSWER_NBYTES = 32
_CONTEXT = b"syncless-pp metadata channel, sender answers challenge\0"
#: How long one pending connection may take to answer the challenge (the real sender answers at once).
HANDSHAKE_S = 5.0
#: Most connections waiting for their answer at once; beyond it the oldest is dropped.
MAX_PENDING = 256
#: At most this many connections are taken from the kernel's queue per turn of the listener's loop, so
#: that a sustained flood (of any user) never keeps it from reading the real sender's answer or its stop.
ACCEPT_BATCH = 32
#: How long close() waits for the listener's thread (it only polls and closes sockets).
CLOSE_JOIN_S = 2.0
#: Refusals logged one by one per listener; the rest are counted and summed up once.
LOGGED_REFUSALS = 8
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: One "posted recv(N)" message, receiver to sender (``depth="auto"``).
_POSTED = struct.Struct("<q")
#: Posted messages one read takes at most (more are read by a second call of the loop).
POSTED_BATCH = 8

PeerCredentials = Callable[[socket.socket], tuple[int, int, int]]


def _message_format(length: int) -> struct.Struct:
    if length < 1:
        raise ValueError(f"a metadata message holds at least the step number; got length {length}")
    return struct.Struct(f"<{length}q")


def is_listener_name(name: object) -> bool:
    """Return whether ``name`` is shaped like a :class:`Listener`'s (so a peer cannot aim connect() elsewhere)."""
    prefix = f"\0{_NAME_PREFIX}-"
    return type(name) is str and name.startswith(prefix) and len(name) < 108 and name[len(prefix):].replace(
        "-", "").isalnum()


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """Return ``(pid, uid, gid)`` of the process that connected ``conn`` (Linux ``SO_PEERCRED``)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def expected_answer(token: bytes, name: str, nonce: bytes) -> bytes:
    """Return the answer to the challenge ``nonce`` of the listener ``name`` whose secret is ``token``."""
    return hmac.new(token, _CONTEXT + name.encode() + b"\0" + nonce, hashlib.sha256).digest()


# Forked children close what they inherited ------------------------------------------

_open: dict[int, weakref.ref[Any]] = {}  # id -> every Listener and endpoint not closed yet


def _track(obj: Any) -> None:
    _open[id(obj)] = weakref.ref(obj)


def _untrack(obj: Any) -> None:
    _open.pop(id(obj), None)


def _close_inherited() -> None:
    """In a forked child: close every socket of this module the parent had open (the parent keeps its own)."""
    for ref in list(_open.values()):
        obj = ref()
        if obj is not None:
            obj._close_in_child()
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


class _Candidate:
    """A pending connection: who it is, when its time is up, and the bytes of its answer so far."""

    __slots__ = ("conn", "deadline", "got", "nonce", "pid")

    def __init__(self, conn: socket.socket, pid: int, deadline: float, nonce: bytes):
        self.conn = conn
        self.pid = pid
        self.deadline = deadline
        self.nonce = nonce
        self.got = b""


class Listener:
    """The receiving end before the sender is authenticated: a listening socket with a unique abstract name.

    A thread of its own accepts, checks and challenges every connection (see
    the module docstring) until the first correct answer, then closes the
    listening socket. Creating it blocks the host for a ``bind``.

    Args:
        credentials: returns ``(pid, uid, gid)`` of a connection's peer;
            tests stand in for ``SO_PEERCRED`` here.
        handshake_s: how long one pending connection may take to answer.
    """

    def __init__(self, *, credentials: PeerCredentials = peer_credentials, handshake_s: float = HANDSHAKE_S):
        self.name = f"\0{_NAME_PREFIX}-{os.getpid()}-{uuid.uuid4().hex}"
        self.token = os.urandom(TOKEN_NBYTES)
        self.refused = 0  # connections turned away so far
        self._credentials = credentials
        self._handshake_s = handshake_s
        self._uid = os.geteuid()
        self._pending: dict[int, _Candidate] = {}
        self._winner: socket.socket | None = None
        self._winner_pid = 0
        self._done = threading.Event()  # set once a sender is authenticated (or the thread stopped)
        self._stop = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.name)
            self._sock.listen(socket.SOMAXCONN)
            self._sock.setblocking(False)
            self._wake_read, self._wake_write = os.pipe()  # non-inheritable, like every fd Python makes
        except OSError:
            self._sock.close()
            raise
        _track(self)
        self._thread = threading.Thread(target=self._serve, name="syncless-pp-meta-listener", daemon=True)
        self._thread.start()

    # The thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        try:
            while not self._stop and self._winner is None:
                now = time.monotonic()
                for fd in [fd for fd, c in self._pending.items() if c.deadline <= now]:
                    self._drop(poller, fd, f"it did not answer the challenge within {self._handshake_s:g} s")
                wait_ms = -1
                if self._pending:
                    nearest = min(c.deadline for c in self._pending.values())
                    wait_ms = max(0, int((nearest - now) * 1000) + 1)
                ready = [fd for fd, _ in poller.poll(wait_ms)]
                # Answers first, then a bounded batch of new connections: a flood cannot starve either.
                for fd in ready:
                    if self._stop or self._winner is not None:
                        break
                    if fd in self._pending:
                        self._read_answer(poller, fd)
                if self._sock.fileno() in ready and not self._stop and self._winner is None:
                    self._accept_some(poller)
        finally:
            why = "the sender was authenticated on another connection" if self._winner else "the listener closed"
            for fd in list(self._pending):
                self._drop(poller, fd, f"{why} before it answered")
            self._sock.close()  # the name goes away: later connections are refused by the kernel
            if self.refused > LOGGED_REFUSALS:
                logger.warning("%s: %d connections were refused in all", self._label(), self.refused)
            self._done.set()

    def _accept_some(self, poller: select.poll) -> None:
        """Take at most ``ACCEPT_BATCH`` connections from the kernel's queue (the rest wait for the next turn)."""
        for _ in range(ACCEPT_BATCH):
            if self._stop or self._winner is not None:
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. EMFILE under a flood: try again shortly, without spinning
                self._refuse(f"accept failed: {err}")
                time.sleep(0.01)
                return
            try:
                pid, uid, _ = self._credentials(conn)
            except OSError as err:
                self._refuse(f"its peer credentials could not be read: {err}")
                conn.close()
                continue
            if uid != self._uid:
                self._refuse(f"it came from pid {pid} of uid {uid}, not this user (uid {self._uid})")
                conn.close()
                continue
            if len(self._pending) >= MAX_PENDING:
                oldest = min(self._pending, key=lambda fd: self._pending[fd].deadline)
                self._drop(poller, oldest, f"{MAX_PENDING} newer connections were waiting")
            nonce = os.urandom(NONCE_NBYTES)
            conn.setblocking(False)
            try:
                conn.send(GREETING + nonce)  # a few bytes into an empty buffer: never blocks
            except OSError as err:
                self._refuse(f"pid {pid} could not be sent the challenge: {err}")
                conn.close()
                continue
            self._pending[conn.fileno()] = _Candidate(conn, pid, time.monotonic() + self._handshake_s, nonce)
            poller.register(conn.fileno(), select.POLLIN)

    def _read_answer(self, poller: select.poll, fd: int) -> None:
        candidate = self._pending[fd]
        try:
            chunk = candidate.conn.recv(ANSWER_NBYTES - len(candidate.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._drop(poller, fd, f"reading its answer failed: {err}")
            return
        if not chunk:
            self._drop(poller, fd, "it hung up without answering the challenge")
            return
        candidate.got += chunk
        if len(candidate.got) < ANSWER_NBYTES:
            return
        if not hmac.compare_digest(candidate.got, expected_answer(self.token, self.name, candidate.nonce)):
            self._drop(poller, fd, "its answer to the challenge is wrong (garbage, a stranger or a replay)")
            return
        poller.unregister(fd)
        del self._pending[fd]
        self._winner, self._winner_pid = candidate.conn, candidate.pid

    def _drop(self, poller: select.poll, fd: int, why: str) -> None:
        candidate = self._pending.pop(fd)
        poller.unregister(fd)
        self._refuse(f"pid {candidate.pid}: {why}")  # logged before the stranger sees its end close
        candidate.conn.close()

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused <= LOGGED_REFUSALS:
            logger.warning("%s: refused a connection: %s", self._label(), why)

    def _label(self) -> str:
        return f"syncless.pp metadata socket @{self.name[1:]}"

    # The caller's side ----------------------------------------------------------------

    def accept(self, length: int, timeout_s: float, what: str) -> Receiver:
        """Wait (at most ``timeout_s``) until the sender is authenticated; return the receiving end.

        Blocks the host; connections of strangers never extend the wait.

        Raises:
            PeerTimeoutError: the sender did not connect (or answer) in time.
        """
        if not self._done.wait(timeout_s) or self._winner is None:
            refused = f" ({self.refused} other connections were refused)" if self.refused else ""
            raise PeerTimeoutError(f"{what}: the previous stage did not connect within {timeout_s:g} s{refused}")
        conn, self._winner = self._winner, None
        return Receiver(conn, length, timeout_s)

    def close(self) -> None:
        """Stop the thread and close every socket still open here (a second call does nothing). Blocks briefly."""
        _untrack(self)
        if self._stop:
            return
        self._stop = True
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass  # the pipe is full (or closed): the thread is awake anyway
        # It only polls and closes sockets, and checks the stop between any two connections it takes:
        # it returns at once. Should it not, its pipe stays open (closing it under a running poll could
        # hand its number to another file), and it closes its own listening socket when it ends.
        self._thread.join(CLOSE_JOIN_S)
        if self._thread.is_alive():
            logger.warning("%s: the listener's thread did not stop within %g s; left to end by itself",
                           self._label(), CLOSE_JOIN_S)
        else:
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
        if self._winner is not None:  # authenticated but never taken by accept()
            self._winner.close()
            self._winner = None

    def _close_in_child(self) -> None:
        # The thread does not exist in the child: close the parent's sockets' copies directly.
        self._stop = True
        for candidate in list(self._pending.values()):
            candidate.conn.close()
        for sock in (self._sock, self._winner):
            if sock is not None:
                sock.close()
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass


def connect(name: str, token: bytes, length: int, timeout_s: float, what: str) -> Sender:
    """Connect to a :class:`Listener` of this node by its name, answer its challenge; return the sending end.

    Blocks the host for at most ``timeout_s``. A full queue at the listener (``EAGAIN``: a local flood)
    or a connection it dropped before its challenge (evicted by a flood) is retried, every few
    milliseconds, until then.

    Raises:
        PeerTimeoutError: nobody listens under ``name``, or it sent no challenge in time, or
            something else answered there.
    """
    deadline = time.monotonic() + timeout_s
    pause_s = 0.001
    while True:
        try:
            return Sender(_handshake(name, token, deadline), length, timeout_s)
        except (BlockingIOError, _DroppedBeforeChallenge) as err:  # the flood's doing: try again, in time
            if time.monotonic() + pause_s >= deadline:
                raise PeerTimeoutError(f"{what}: could not reach the next stage's metadata socket within "
                                       f"{timeout_s:g} s (its queue stayed full: a local flood?): {err}") from err
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.05)
        except OSError as err:  # socket.timeout and ConnectionError are OSErrors
            raise PeerTimeoutError(f"{what}: could not reach the next stage's metadata socket: {err}") from err


class _DroppedBeforeChallenge(ConnectionError):
    """The listener closed the connection before its challenge (a flood evicted it): worth a retry."""


def _handshake(name: str, token: bytes, deadline: float) -> socket.socket:
    """One attempt: connect, read the challenge, answer it; return the connected socket (closed on failure)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(name)
        challenge = b""
        while len(challenge) < CHALLENGE_NBYTES:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(CHALLENGE_NBYTES - len(challenge))
            if not chunk:
                raise _DroppedBeforeChallenge("the listener closed the connection before its challenge")
            challenge += chunk
        if not challenge.startswith(GREETING):
            raise ConnectionError(f"the listener sent {challenge[:len(GREETING)]!r}, not the syncless greeting")
        sock.sendall(expected_answer(token, name, challenge[len(GREETING):]), socket.MSG_NOSIGNAL)
    except BaseException:
        sock.close()
        raise
    return sock


class _Endpoint:
    """One connected end: the socket with its timeout, and a buffer for one fixed-length message."""

    def __init__(self, sock: socket.socket, length: int, timeout_s: float):
        self._sock = sock
        self._sock.settimeout(timeout_s)
        self._timeout_s = timeout_s
        self._format = _message_format(length)
        self._buffer = bytearray(self._format.size)
        _track(self)

    def close(self) -> None:
        """Close the socket (a second call does nothing)."""
        _untrack(self)
        self._sock.close()

    def peer_pid(self) -> int | None:
        """The process id of the other end (the kernel's ``SO_PEERCRED``), or None where it cannot say."""
        option = getattr(socket, "SO_PEERCRED", None)
        if option is None:
            return None
        try:
            raw = self._sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
        except OSError:
            return None
        return struct.unpack("3i", raw)[0]

    def shutdown(self) -> None:
        """Shut the connection both ways without closing the socket; never raises. Safe from any thread.

        A thread blocked reading or writing it returns at once (a read sees the end of the stream, a
        write fails), and the peer sees the connection end. ``abort()`` uses it; ``close()`` still
        releases the socket.
        """
        with contextlib.suppress(OSError):  # not connected any more, or already closed
            self._sock.shutdown(socket.SHUT_RDWR)

    def _close_in_child(self) -> None:
        self._sock.close()


class Sender(_Endpoint):
    """Sends ``[step, *rows]`` messages of a fixed length; one per step, in order.

    A send blocks only while the receiver's socket buffer is full (a few
    hundred messages unread), at most ``timeout_s``.

    The reverse direction (``depth="auto"`` only): the receiver posts each
    recv() it starts (:meth:`Receiver.post`, one int64 each), and
    :meth:`read_posted` takes what has arrived without blocking.
    """

    def __init__(self, sock: socket.socket, length: int, timeout_s: float):
        super().__init__(sock, length, timeout_s)
        self._posted = bytearray(8 * POSTED_BATCH)
        self._posted_view = memoryview(self._posted)
        self._posted_got = 0  # bytes of a message read so far (a stream socket may split one)

    def read_posted(self) -> list[int]:
        """Return the values the receiver posted since the last call, oldest first; never blocks the host.

        One ``readv`` system call when at most :data:`POSTED_BATCH` messages are waiting (the auto protocol
        leaves at most two). The socket is in timeout mode, which Python keeps non-blocking at the
        system level (documented for ``socket.settimeout``), so the read returns at once; a read through
        the socket object would first wait up to the timeout for data.

        Raises:
            PeerTimeoutError: the next stage closed its end (it died, aborted or closed the transport), or
                the read failed.
        """
        values: list[int] = []
        fd = self._sock.fileno()
        while True:
            got = self._posted_got
            try:
                count = os.readv(fd, [self._posted_view[got:]])
            except BlockingIOError:
                return values
            except InterruptedError:
                continue
            except OSError as err:
                raise PeerTimeoutError(f"the next stage's metadata socket failed (it may have died): {err}") from err
            if count == 0:
                raise PeerTimeoutError(
                    "the next stage closed its metadata socket (it died, aborted or closed the transport)"
                )
            got += count
            whole = got - got % 8
            values.extend(struct.unpack_from(f"<{whole // 8}q", self._posted))
            self._posted[: got - whole] = self._posted[whole:got]
            self._posted_got = got - whole
            if got < len(self._posted):
                return values  # the socket had less than the buffer holds: nothing more is waiting

    def close(self) -> None:
        """Close the socket (a second call does nothing), first taking what the receiver posted and nobody read.

        Closing a Unix socket with unread bytes makes the peer's next read fail with a reset instead of
        seeing the end of the stream, so the one or two unread "posted" messages are read away first.
        """
        if self._sock.fileno() >= 0:
            with contextlib.suppress(PeerTimeoutError):
                self.read_posted()
        super().close()

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
            except ConnectionResetError as err:  # it closed with bytes of ours unread (a crash, an abort)
                raise PeerTimeoutError(
                    f"{what}: the previous stage closed its metadata socket (it died or closed the transport): {err}"
                ) from err
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

    def post(self, step: int) -> bool:
        """Tell the sender this stage's stream has the entry of recv(``step``) enqueued (``depth="auto"``).

        One small send; it waits only while the sender's socket buffer is full, which the protocol
        rules out (the sender reads every posted value at each send, so at most two are unread).
        Returns False when it could not be sent (the sender closed its end or died): the sender then
        never learns that this step was posted and sends it through a slot, and the metadata read
        that follows reports the closed connection.
        """
        try:
            self._sock.sendall(_POSTED.pack(step), socket.MSG_NOSIGNAL)
        except OSError as err:
            logger.debug("posting recv(%d) to the previous stage failed: %s", step, err)
            return False
        return True
