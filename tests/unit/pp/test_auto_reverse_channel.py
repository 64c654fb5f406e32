"""``depth="auto"``'s reverse messages on the metadata socket: posted recv(N), read without blocking, checked.

Over a real authenticated pair of the metadata channel (``_meta_channel``), on the CPU.
"""

from __future__ import annotations

import struct
import time

import pytest

from syncless._core.errors import PeerTimeoutError, TransportFailedError
from syncless.pp import _meta_channel as meta_channel
from syncless.pp._auto import PostedLog

pytestmark = pytest.mark.timeout(60)


def _pair(length=3, timeout_s=5.0):
    listener = meta_channel.Listener()
    sender = meta_channel.connect(listener.name, listener.token, length, timeout_s, "test")
    receiver = listener.accept(length, timeout_s, "test")
    listener.close()
    return sender, receiver


def test_reading_posted_never_waits_for_the_socket_timeout():
    sender, receiver = _pair(timeout_s=5.0)
    start = time.monotonic()
    for _ in range(1000):
        assert sender.read_posted() == []
    assert time.monotonic() - start < 2.0  # a read through the socket object would wait 5 s once
    sender.close()
    receiver.close()


def test_posts_arrive_in_order_and_only_once():
    sender, receiver = _pair()
    assert receiver.post(1) and receiver.post(2)
    deadline = time.monotonic() + 5
    got = []
    while len(got) < 2 and time.monotonic() < deadline:
        got += sender.read_posted()
    assert got == [1, 2]
    assert sender.read_posted() == []
    for step in range(3, 3 + 3 * meta_channel.POSTED_BATCH):  # more than one read takes
        receiver.post(step)
    time.sleep(0.05)
    assert sender.read_posted() == list(range(3, 3 + 3 * meta_channel.POSTED_BATCH))
    sender.close()
    receiver.close()


def test_a_post_split_by_the_kernel_is_reassembled():
    sender, receiver = _pair()
    frame = struct.pack("<q", 1) + struct.pack("<q", 2)
    for index, byte in enumerate(frame):
        receiver._sock.send(bytes([byte]))
        time.sleep(0.002)
        got = sender.read_posted()
        if index == 7:
            assert got == [1]
        elif index == 15:
            assert got == [2]
        else:
            assert got == []
    sender.close()
    receiver.close()


def test_garbage_from_the_peer_is_a_protocol_error_never_a_step():
    sender, receiver = _pair()
    log = PostedLog("stage 0 (rank 0) sending to stage 1 (rank 1)")
    receiver._sock.send(struct.pack("<q", 1) + struct.pack("<q", 1))  # a replay of recv(1)
    time.sleep(0.05)
    with pytest.raises(TransportFailedError, match=r"posted recv\(1\) while step 2 is being sent \(expected 2"):
        log.accept(sender.read_posted(), 2)
    sender.close()
    receiver.close()


def test_a_receiver_that_closed_makes_the_read_raise_at_once():
    sender, receiver = _pair()
    receiver.close()
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        sender.read_posted()
    sender.close()


def test_posting_to_a_sender_that_closed_returns_false_instead_of_raising():
    sender, receiver = _pair()
    sender.close()
    time.sleep(0.05)
    results = [receiver.post(step) for step in range(1, 4)]
    assert results[-1] is False  # the first may still be taken by the kernel; by then the peer is gone
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        receiver.recv(1.0, "step 1")
    receiver.close()


def test_a_sender_closing_with_posts_unread_still_looks_closed_not_silent():
    # Closing a Unix socket with unread bytes resets the peer; Sender.close() reads them away first.
    sender, receiver = _pair()
    receiver.post(1)
    time.sleep(0.05)
    start = time.monotonic()
    sender.close()
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        receiver.recv(3.0, "step 1")
    assert time.monotonic() - start < 2.0
    receiver.close()


def test_a_sender_that_dies_with_posts_unread_is_reported_as_closed():
    # A crash cannot drain: the receiver sees a reset, reported as the closed connection it is.
    sender, receiver = _pair()
    receiver.post(1)
    time.sleep(0.05)
    sender._sock.close()  # what the kernel does for a process that died
    with pytest.raises(PeerTimeoutError, match="closed its metadata socket"):
        receiver.recv(3.0, "step 1")
    receiver.close()


def test_a_link_back_to_the_process_a_stage_receives_from_is_seen_by_its_process_id():
    """A receiver posts only while its process sends nothing to the process it receives from (a cycle through a
    slot wait can deadlock under auto where depth=2 finishes; found in review). Stages in one process (threads)
    are not told apart, so a link to this very process never counts."""
    import os

    from syncless.pp import _copy_engine_auto as auto

    peer = os.getpid() + 1_000_000  # no such process needs to exist: only the number is compared
    assert not auto.links_back_to(peer)
    auto._add_link(auto._sends_to, peer)
    try:
        assert auto.links_back_to(peer)
        assert not auto.links_back_to(None) and not auto.links_back_to(peer + 1)
        auto._add_link(auto._sends_to, os.getpid())
        assert not auto.links_back_to(os.getpid())
        auto._drop_link(auto._sends_to, os.getpid())
    finally:
        auto._forget(peer, None)
    assert not auto.links_back_to(peer) and peer not in auto._sends_to
