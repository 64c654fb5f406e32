"""Local attackers against the metadata socket: nobody can delay set-up or steps, and every attempt is logged.

Each test plays the stranger with raw sockets in this process (or a forked
child of another uid) and the real sender with :func:`connect`. Set-up must
end far below its timeout (30 s here); no test asserts a tight time.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from syncless._core.errors import PeerTimeoutError
from syncless.pp import _meta_channel as meta_channel

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S = 30.0  # set-up's timeout: every accept below must end long before it
FAST_S = 5.0  # "well below the timeout"
LOGGER = "syncless.pp._meta_channel"


def _stranger(name):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(name)
    return sock


def _read_challenge(sock):
    got = b""
    while len(got) < meta_channel.CHALLENGE_NBYTES:
        chunk = sock.recv(meta_channel.CHALLENGE_NBYTES - len(got))
        if not chunk:
            raise AssertionError(f"the listener hung up after {len(got)} bytes of its challenge")
        got += chunk
    assert got.startswith(meta_channel.GREETING)
    return got[len(meta_channel.GREETING):]


def _until_closed(sock):
    """Read until the listener closes ``sock``; return what came (the challenge at most)."""
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:  # closed while bytes we sent were still unread there
            return got
        if not chunk:
            return got
        got += chunk


def _connect_and_accept(listener):
    start = time.monotonic()
    sender = meta_channel.connect(listener.name, listener.token, 2, TIMEOUT_S, "test")
    receiver = listener.accept(2, TIMEOUT_S, "test")
    elapsed = time.monotonic() - start
    assert elapsed < FAST_S, f"set-up of the channel took {elapsed:.1f} s with a {TIMEOUT_S:g} s timeout"
    return sender, receiver


def _steps_flow(sender, receiver, count=50):
    for step in range(1, count + 1):
        sender.send(step, [step * 7919])
        assert receiver.recv(FAST_S, "step") == (step, step * 7919)


def _refusals(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_silent_stranger_connected_first_does_not_delay_the_sender_and_is_logged(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    listener = meta_channel.Listener()
    stranger = _stranger(listener.name)  # first in the queue, and it never says a word
    sender, receiver = _connect_and_accept(listener)
    _steps_flow(sender, receiver)
    # Once the sender is in, the stranger is turned away: it got a challenge, then the end of the stream.
    assert len(_until_closed(stranger)) == meta_channel.CHALLENGE_NBYTES
    listener.close()
    assert any("authenticated on another connection" in m and f"pid {os.getpid()}" in m for m in _refusals(caplog))
    assert listener.refused == 1
    for sock in (stranger, sender, receiver):
        sock.close()


def test_a_silent_stranger_alone_is_dropped_at_its_own_deadline_and_logged(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    listener = meta_channel.Listener(handshake_s=0.3)
    stranger = _stranger(listener.name)
    start = time.monotonic()
    _until_closed(stranger)
    assert time.monotonic() - start < FAST_S
    assert any("did not answer the challenge within 0.3 s" in m for m in _refusals(caplog))
    sender, receiver = _connect_and_accept(listener)  # the listener still serves the real sender
    _steps_flow(sender, receiver, 5)
    for sock in (stranger, sender, receiver, listener):
        sock.close()


def test_strangers_that_send_garbage_are_refused_and_logged_and_the_sender_gets_through(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    listener = meta_channel.Listener()
    short = _stranger(listener.name)
    short.sendall(os.urandom(meta_channel.ANSWER_NBYTES))  # an answer-sized random guess
    flood = _stranger(listener.name)
    flood.setblocking(False)
    try:
        flood.send(os.urandom(1 << 20))  # as much garbage as the socket takes
    except BlockingIOError:
        pass
    token_itself = _stranger(listener.name)
    token_itself.sendall(listener.token)  # even the secret token is not an answer: it never crosses the socket
    hung_up = _stranger(listener.name)
    hung_up.close()
    sender, receiver = _connect_and_accept(listener)
    _steps_flow(sender, receiver)
    for sock in (short, token_itself):
        _until_closed(sock)
    listener.close()
    refusals = _refusals(caplog)
    assert sum("answer to the challenge is wrong" in m for m in refusals) >= 2, refusals
    assert listener.refused >= 3
    for sock in (short, flood, token_itself, sender, receiver):
        sock.close()


def test_a_replayed_answer_is_refused_and_the_real_sender_is_the_one_connected(caplog):
    """The attacker sees the real sender's answer and replays it, first on a connection it opened earlier."""
    caplog.set_level(logging.WARNING, LOGGER)
    listener = meta_channel.Listener()
    attacker = _stranger(listener.name)
    _read_challenge(attacker)
    real = _stranger(listener.name)  # the real sender, answering by hand so the test holds its answer
    real_nonce = _read_challenge(real)
    captured = meta_channel.expected_answer(listener.token, listener.name, real_nonce)
    attacker.sendall(captured + (666).to_bytes(8, "little") * 2)  # replayed before the real one arrives
    assert _until_closed(attacker) == b""  # refused: the answer belongs to another connection's nonce
    real.sendall(captured + (1).to_bytes(8, "little") + (42).to_bytes(8, "little"))
    start = time.monotonic()
    receiver = listener.accept(2, TIMEOUT_S, "test")
    assert time.monotonic() - start < FAST_S
    assert receiver.recv(FAST_S, "step 1") == (1, 42)  # the real sender's frame, not the attacker's 666
    assert any("wrong (garbage, a stranger or a replay)" in m for m in _refusals(caplog))
    listener.close()
    for sock in (attacker, real, receiver):
        sock.close()


def test_an_answer_captured_in_an_earlier_set_up_is_refused(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    old = meta_channel.Listener()
    sniffed = {}
    original = meta_channel.expected_answer

    def record(token, name, nonce):  # what a wiretap on the old connection would have seen
        sniffed["answer"] = original(token, name, nonce)
        return sniffed["answer"]

    meta_channel.expected_answer = record
    try:
        old_sender, old_receiver = _connect_and_accept(old)
    finally:
        meta_channel.expected_answer = original
    old.close()
    new = meta_channel.Listener()
    replay = _stranger(new.name)
    _read_challenge(replay)
    replay.sendall(sniffed["answer"])
    assert _until_closed(replay) == b""
    sender, receiver = _connect_and_accept(new)
    _steps_flow(sender, receiver, 5)
    assert any("answer to the challenge is wrong" in m for m in _refusals(caplog))
    for sock in (old_sender, old_receiver, replay, sender, receiver, new):
        sock.close()


def test_a_connection_from_another_uid_is_refused_before_any_challenge(caplog):
    """SO_PEERCRED stand-in: the first connection claims another user."""
    caplog.set_level(logging.WARNING, LOGGER)
    calls = []

    def credentials(conn):
        pid, uid, gid = meta_channel.peer_credentials(conn)
        calls.append(pid)
        return (pid, uid + 1, gid) if len(calls) == 1 else (pid, uid, gid)

    listener = meta_channel.Listener(credentials=credentials)
    foreign = _stranger(listener.name)
    assert _until_closed(foreign) == b""  # closed at once: not even a challenge
    sender, receiver = _connect_and_accept(listener)
    _steps_flow(sender, receiver, 5)
    assert any(f"of uid {os.geteuid() + 1}, not this user" in m for m in _refusals(caplog))
    for sock in (foreign, sender, receiver, listener):
        sock.close()


def test_the_real_peer_credentials_name_this_process():
    listener = meta_channel.Listener()
    sender, receiver = _connect_and_accept(listener)
    pid, uid, gid = meta_channel.peer_credentials(receiver._sock)
    assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())
    for sock in (sender, receiver, listener):
        sock.close()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_a_process_of_another_real_uid_is_refused_and_logged(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    # Fork before the listener's thread exists; the child waits for the name on a pipe.
    name_read, name_write = os.pipe()
    result_read, result_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(name_write)
            name = os.read(name_read, 4096).decode()
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10.0)
            sock.connect(name)  # abstract sockets have no file permissions: the kernel lets it in
            got = sock.recv(4096)
            os.write(result_write, b"closed" if got == b"" else b"challenged")
            code = 0
        finally:
            os._exit(code)
    os.close(name_read)
    os.close(result_write)
    listener = meta_channel.Listener()
    os.write(name_write, listener.name.encode())
    os.close(name_write)
    outcome = os.read(result_read, 64)
    os.close(result_read)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert outcome == b"closed"
    sender, receiver = _connect_and_accept(listener)
    _steps_flow(sender, receiver, 5)
    assert any(f"pid {child} of uid 65534, not this user" in m for m in _refusals(caplog)), _refusals(caplog)
    for sock in (sender, receiver, listener):
        sock.close()


def test_a_flood_of_silent_connections_neither_blocks_connect_nor_delays_accept(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    listener = meta_channel.Listener()
    # More than the listener keeps pending, all before the sender: its thread drains the kernel's queue,
    # so the real connect() does not block on a full backlog, and evicting the oldest keeps memory bounded.
    strangers = [_stranger(listener.name) for _ in range(meta_channel.MAX_PENDING + 40)]
    sender, receiver = _connect_and_accept(listener)
    _steps_flow(sender, receiver, 5)
    listener.close()
    assert listener.refused == len(strangers)
    assert len(_refusals(caplog)) <= meta_channel.LOGGED_REFUSALS + 1  # logged one by one, then summed up
    assert any(f"{len(strangers)} connections were refused in all" in m for m in _refusals(caplog))
    for sock in (*strangers, sender, receiver):
        sock.close()


def test_after_set_up_nobody_else_can_connect_and_steps_run_undisturbed():
    listener = meta_channel.Listener()
    sender, receiver = _connect_and_accept(listener)
    deadline = time.monotonic() + FAST_S
    while True:  # the listener's thread closes the listening socket right after the sender's answer
        try:
            late = _stranger(listener.name)
        except (ConnectionRefusedError, FileNotFoundError):
            break
        late.close()
        assert time.monotonic() < deadline, "the metadata socket still takes connections after set-up"
        time.sleep(0.01)
    _steps_flow(sender, receiver)
    for sock in (sender, receiver, listener):
        sock.close()


def _dead_sender_is_seen_at_once(receiver):
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        receiver.recv(TIMEOUT_S, "step after the sender died")
    return time.monotonic() - start


def test_a_forked_child_does_not_keep_a_dead_senders_connection_open():
    listener = meta_channel.Listener()
    sender, receiver = _connect_and_accept(listener)
    listener.close()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child: it inherited copies of both ends
        try:
            time.sleep(8)
        finally:
            os._exit(0)
    try:
        sender.close()  # the sender "dies"; the child's copy, had it kept one, would hold the stream open
        assert _dead_sender_is_seen_at_once(receiver) < FAST_S
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    receiver.close()


def test_a_program_started_by_the_sender_does_not_inherit_its_socket():
    listener = meta_channel.Listener()
    sender, receiver = _connect_and_accept(listener)
    listener.close()
    # close_fds=False: only fds marked inheritable would survive the exec.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(8)"], close_fds=False)
    try:
        sender.close()
        assert _dead_sender_is_seen_at_once(receiver) < FAST_S
    finally:
        child.kill()
        child.wait()
    receiver.close()


def _flooders(name, count, seconds):
    """Fork ``count`` processes that connect to ``name`` and hang up, as fast as they can, for ``seconds``."""
    children = []
    for _ in range(count):
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            end = time.monotonic() + seconds
            try:
                while time.monotonic() < end:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    try:
                        sock.connect(name)
                    except OSError:
                        pass
                    sock.close()
            finally:
                os._exit(0)
        children.append(child)
    return children


def _reap(children):
    for child in children:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
        os.waitpid(child, 0)


@pytest.mark.parametrize("foreign", [False, True])
def test_a_sustained_flood_delays_neither_set_up_nor_close(foreign):
    """Flooders that connect and hang up without pause, of this user or (stand-in) another one: the real
    sender still gets in well within the timeout, and close() returns at once while the flood goes on."""
    me = os.getpid()

    def credentials(conn):
        pid, uid, gid = meta_channel.peer_credentials(conn)
        return (pid, uid + 1, gid) if foreign and pid != me else (pid, uid, gid)

    listener = meta_channel.Listener(credentials=credentials)
    children = _flooders(listener.name, 3, 20.0)
    try:
        time.sleep(0.5)  # the flood is on
        start = time.monotonic()
        sender = meta_channel.connect(listener.name, listener.token, 2, 10.0, "test")
        receiver = listener.accept(2, 10.0, "test")
        took = time.monotonic() - start
        assert took < FAST_S, f"set-up took {took:.1f} s under the flood"
        _steps_flow(sender, receiver, 5)
        assert listener.refused > 0  # the flood did reach the listener
        second = meta_channel.Listener(credentials=credentials)
        more = _flooders(second.name, 3, 20.0)
        try:
            time.sleep(0.5)
            start = time.monotonic()
            second.close()  # nobody will connect: it must stop at once, flood or not
            assert time.monotonic() - start < 1.5
            assert not second._thread.is_alive()
        finally:
            _reap(more)
    finally:
        _reap(children)
    for sock in (sender, receiver, listener):
        sock.close()
