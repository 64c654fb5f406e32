"""The copy-engine transport's metadata socket: framing, order, timeouts and a peer that goes away.

The local-attacker tests (strangers that stay silent, send garbage, replay a
captured answer, come from another user, or flood the queue) are in
``test_meta_channel_attackers.py``.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from syncless._core.errors import PeerTimeoutError
from syncless.pp import _meta_channel as meta_channel

pytestmark = pytest.mark.timeout(60)


def _pair(length, timeout_s=5.0):
    listener = meta_channel.Listener()
    sender = meta_channel.connect(listener.name, listener.token, length, timeout_s, "test")
    receiver = listener.accept(length, timeout_s, "test")
    listener.close()
    return sender, receiver


def test_messages_arrive_whole_and_in_order_with_random_values():
    rng = random.Random(20261130)
    sender, receiver = _pair(4)
    sent = [(step, [rng.randint(0, 2**40) for _ in range(3)]) for step in range(1, 2001)]

    def produce():
        for step, rows in sent:
            sender.send(step, rows)

    thread = threading.Thread(target=produce)
    thread.start()
    got = [receiver.recv(5.0, "step") for _ in sent]
    thread.join()
    assert got == [(step, *rows) for step, rows in sent]
    sender.close()
    receiver.close()


def test_a_message_split_by_the_kernel_is_reassembled():
    sender, receiver = _pair(2)
    raw = sender._sock  # write the frame byte by byte underneath the Sender
    payload = (7).to_bytes(8, "little") + (123456789).to_bytes(8, "little")

    def dribble():
        for byte in payload:
            raw.send(bytes([byte]))
            time.sleep(0.001)

    thread = threading.Thread(target=dribble)
    thread.start()
    assert receiver.recv(5.0, "step") == (7, 123456789)
    thread.join()
    sender.close()
    receiver.close()


def test_receive_times_out_with_a_clear_error_when_nothing_comes():
    sender, receiver = _pair(2)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="sent nothing within 0.2 s"):
        receiver.recv(0.2, "stage 1 receiving step 1")
    assert 0.15 < time.monotonic() - start < 3.0
    sender.close()
    receiver.close()


def test_a_sender_that_goes_away_ends_the_wait_at_once():
    sender, receiver = _pair(2)
    sender.send(1, [5])
    sender.close()  # what the kernel does when the sender's process dies
    assert receiver.recv(5.0, "step") == (1, 5)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        receiver.recv(30.0, "step 2")
    assert time.monotonic() - start < 2.0
    receiver.close()


def test_sending_to_a_closed_receiver_raises_peer_timeout():
    sender, receiver = _pair(2, timeout_s=1.0)
    receiver.close()
    with pytest.raises(PeerTimeoutError, match="closed its end|took no metadata"):
        for step in range(1, 100_000):  # the first sends may still fit the socket buffer
            sender.send(step, [0])
    sender.close()


def test_a_sender_blocked_by_a_reader_that_stopped_gives_up_after_its_timeout():
    sender, receiver = _pair(64, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError):
        for step in range(1, 1_000_000):  # 512-byte messages fill the socket buffer quickly
            sender.send(step, [0] * 63)
    assert time.monotonic() - start < 10.0
    sender.close()
    receiver.close()


def test_connect_to_a_name_nobody_listens_on_raises():
    listener = meta_channel.Listener()
    name = listener.name
    listener.close()
    with pytest.raises(PeerTimeoutError, match="could not reach"):
        meta_channel.connect(name, b"x" * meta_channel.TOKEN_NBYTES, 2, 1.0, "test")


def test_connect_to_something_that_is_not_a_listener_raises():
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = "\0syncless-pp-test-impostor-" + str(random.random())
    impostor.bind(name)
    impostor.listen(1)

    def greet_wrongly():
        conn, _ = impostor.accept()
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 40)
        time.sleep(0.5)
        conn.close()

    thread = threading.Thread(target=greet_wrongly)
    thread.start()
    with pytest.raises(PeerTimeoutError, match="not the syncless greeting"):
        meta_channel.connect(name, b"x" * meta_channel.TOKEN_NBYTES, 2, 5.0, "test")
    thread.join()
    impostor.close()


def test_accept_without_a_sender_times_out():
    listener = meta_channel.Listener()
    with pytest.raises(PeerTimeoutError, match="did not connect within 0.1 s"):
        listener.accept(2, 0.1, "test")
    listener.close()


def test_every_listener_has_its_own_name_and_token():
    first, second = meta_channel.Listener(), meta_channel.Listener()
    assert first.name != second.name and first.name.startswith("\0syncless-pp-")
    assert first.token != second.token and len(first.token) == meta_channel.TOKEN_NBYTES
    first.close()
    second.close()


def test_closing_a_listener_twice_is_harmless_and_stops_its_thread():
    listener = meta_channel.Listener()
    listener.close()
    listener.close()
    assert not listener._thread.is_alive()


def test_a_message_needs_at_least_the_step_number():
    with pytest.raises(ValueError, match="at least the step number"):
        meta_channel._message_format(0)


def test_sending_to_a_dead_peer_raises_even_when_sigpipe_would_kill(tmp_path):
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    import syncless

    script = tmp_path / "sigpipe.py"
    script.write_text(textwrap.dedent("""
        import signal
        from syncless._core.errors import PeerTimeoutError
        from syncless.pp import _meta_channel as mc
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        listener = mc.Listener()
        sender = mc.connect(listener.name, listener.token, 2, 2.0, "test")
        receiver = listener.accept(2, 2.0, "test")
        receiver.close()
        listener.close()
        try:
            for step in range(1, 100000):
                sender.send(step, [0])
        except PeerTimeoutError:
            print("raised")
    """))
    env = {**os.environ, "PYTHONPATH": str(Path(syncless.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env, check=False)
    # The child set SIGPIPE to SIG_DFL, so without MSG_NOSIGNAL it would have died with 141 (-13 here).
    assert done.returncode == 0 and "raised" in done.stdout, (done.returncode, done.stderr)


def test_a_silent_stranger_that_connects_late_does_not_extend_accepts_deadline():
    listener = meta_channel.Listener()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # It connects 0.6 s into a 1 s accept and sends nothing: waiting for its answer must end at accept's
    # deadline (1 s), not a full timeout after it connected (1.6 s).
    late = threading.Timer(0.6, stranger.connect, args=(listener.name,))
    start = time.monotonic()
    late.start()
    with pytest.raises(PeerTimeoutError, match="did not connect within 1 s"):
        listener.accept(2, 1.0, "test")
    elapsed = time.monotonic() - start
    late.join()
    assert 0.9 < elapsed < 1.3
    stranger.close()
    listener.close()


def test_an_answer_that_arrives_in_two_writes_is_accepted():
    listener = meta_channel.Listener()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5.0)

    def answer_in_halves():
        raw.connect(listener.name)
        challenge = b""
        while len(challenge) < meta_channel.CHALLENGE_NBYTES:
            challenge += raw.recv(meta_channel.CHALLENGE_NBYTES - len(challenge))
        nonce = challenge[len(meta_channel.GREETING):]
        answer = meta_channel.expected_answer(listener.token, listener.name, nonce)
        raw.sendall(answer[:10])
        time.sleep(0.2)  # the listener has read the first part by now and waits for the rest
        raw.sendall(answer[10:] + (11).to_bytes(8, "little") + (-3).to_bytes(8, "little", signed=True))

    thread = threading.Thread(target=answer_in_halves)
    thread.start()
    receiver = listener.accept(2, 5.0, "test")
    thread.join()
    assert receiver.recv(5.0, "step") == (11, -3)  # bytes after the answer are the first step, untouched
    for sock in (raw, receiver, listener):
        sock.close()


def test_shutdown_ends_a_blocked_receive_at_once_and_is_harmless_after_close():
    # abort() calls it from another thread (or a signal handler) while recv() waits for a step.
    sender, receiver = _pair(2, timeout_s=30.0)
    outcome = {}

    def wait_for_a_step():
        start = time.monotonic()
        try:
            receiver.recv(30.0, "step 1")
        except PeerTimeoutError as err:
            outcome["error"] = str(err)
        outcome["waited_s"] = time.monotonic() - start

    thread = threading.Thread(target=wait_for_a_step)
    thread.start()
    time.sleep(0.2)  # the receive is blocked in the kernel by now
    receiver.shutdown()
    thread.join(10)
    assert "closed its metadata socket" in outcome["error"] and outcome["waited_s"] < 5.0
    with pytest.raises(PeerTimeoutError):  # the sender sees the connection end too
        for _ in range(100_000):
            sender.send(1, [2])
    for endpoint in (receiver, sender):
        endpoint.close()
        endpoint.shutdown()  # after close: does nothing, raises nothing
