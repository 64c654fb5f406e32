"""``depth="auto"``: one step at a time, straight into the receiver's persistent tensors or through a slot.

This module is the protocol of the auto mode, in plain Python over the driver
calls of ``_driver.Hot`` (``memcpy``, ``memcpy_all``, ``wait_geq``, ``write``,
``record``, ``wait_event``), so the CPU tests drive this very code against a
simulated pair of GPUs. The transport (``_copy_engine_auto``) adds the host
side: the step's metadata, the watchdog's brackets, the failures.
``docs/pp-sizes-probe.md`` ("Choosing per step") is the design it implements.

The flags. Both live where ``depth >= 1`` keeps them (``_copy_engine``'s
buffer): ``full`` on the receiver, written by the sender (the last step
delivered, whatever its path), and ``W`` (the buffer's ``empty`` word) on the
sender, written by the receiver. ``W`` is one monotone word for both paths::

    W = 2N-1   at the start of recv(N), before its metadata is read: everything
               queued on the receiver's stream before recv(N) is done (the readers
               of step N-1, and the copy-out of every slot step <= N-1), so the
               persistent tensors are free for step N and every slot of a step
               <= N-1 is free.
    W = 2N     at the end of recv(N), whatever its path: after a slot step's
               copy-out (its slot is free); after a direct step's data landed
               (it used no slot, and every earlier slot was free at its entry).

Step N, with D slots (slot s = (N-1) % D)::

    direct, sender on the caller's stream:
        (pre) wait W >= 2N-1, copy each tensor -> receiver's persistent tensors, full = N (sent) (post)
    direct, receiver on its current stream:
        W = 2N-1 ... (reads the metadata on the host) ... (pre) wait full >= N, W = 2N (received) (post)

    slot, sender on the relay stream, fenced to the caller's stream:
        relay:   (pre) [wait W >= 2(N-D) if N > D] (waited) wait ready, copy -> slot s, full = N (sent) (post)
        caller:  ...producers of N... (ready) ....................................... wait post, ...
    slot, receiver on its current stream:
        W = 2N-1 ... (pre) wait full >= N, copy slot s -> persistent, W = 2N (received) (post)

Why each wait is enough (every value of W and full only grows, below):

- A direct step N copies into the persistent tensors only after ``W >= 2N-1``. No
  write before recv(N)'s entry writes a value that large (entries of earlier
  steps write 2k-1 <= 2N-3, copy-outs 2k <= 2N-2), and the entry write of N is
  enqueued after everything the receiver queued before recv(N): the readers of
  step N-1, and the copy-out of step N-1 if it was a slot step (which writes the
  persistent tensors too). So the copies of step N overwrite nothing still needed.
- A slot step N copies into slot s only after ``W >= 2(N-D)``. The slot was last
  used by step N-D at the latest (or by an earlier one, which used the slot before
  it). A value v >= 2(N-D) is written either as 2k after the copy-out of slot step
  k >= N-D, or as 2k-1 by the entry of step k >= N-D+1; both come after the copy-out
  of every slot step <= N-D in the receiver's stream order. So when step N-D was
  a slot step, its copy-out is done; when it was direct (it used no slot), the end
  of recv(N-D) wrote 2(N-D) after its data landed, and every slot step before it
  had been copied out before its entry. (The first version wrote 2N only after a
  copy-out, so after a direct step N-D the slot waited for recv(N-D+1)'s entry:
  one slot fewer in flight, and a review found a two-link exchange that then
  deadlocked where ``depth=D`` finishes.)
- The receiver reads slot s, or the persistent tensors (after a direct step),
  only after ``full >= N``: the sender writes ``full = N`` after the step's copies
  on the same stream (NVLink delivers the data before the flag write that follows
  it), and after every earlier step's ``full`` write (below), so ``full >= N``
  means every step <= N has landed.
- A direct step's copies into the persistent tensors cannot race a slot step's
  copy-out: the copy-out of a slot step k < N is queued before the entry of N
  that the direct copies wait for; the copy-out of a slot step k > N waits for
  ``full >= k``, written after step N's copies.

In order whatever stream each step runs on (so ``full`` only grows): direct steps
run on the caller's current stream, slot steps on the relay. Each step records
``sent`` right after its ``full`` write; a step whose stream differs from the
previous step's first waits for ``sent`` (on the relay too, when the previous step
was direct). The receiver's W writes stay in order the same way: each recv()
records ``received`` after its last W write, and a recv() on another stream than
the previous one waits for it before its entry write.

Why "posted" (the sender sends step N direct only once the receiver's host has
posted recv(N), see the module ``_meta_channel`` for the message): a direct step
makes the sender's *stream* wait for the receiver's stream to reach recv(N), so two
stages that each send before they receive, on one stream each, would wait for
each other until the timeout (depth 0's rendezvous) where depth 2 works. With the
rule, a direct wait of sender X points to an entry write that Y's host enqueued
before X decided; whatever that write waits for on Y's GPU was enqueued on Y's host
earlier still (stream order, earlier events), or is a direct wait whose own entry
write is earlier again, or a slot wait (the ``depth=D`` protocol, which makes no
cycle). Along any chain of direct waits and stream order the enqueue times
strictly decrease.

That argument does not cover a chain that passes through a slot wait *and*
comes back: a slot wait points at the receiver's later work. Stages whose links
form a cycle (a return link from a later stage to an earlier one, as a first
stage that sends micro-batches and then collects results from the last) can
then wait for each other through a direct step where ``depth=D`` finishes
(found in review, on a simulated pair: X sends 4 steps then receives 4; Y
receives, computes and sends back each). So a receiver that also sends to the
process it receives from (a link back, seen by the peer's process id on the
metadata sockets) never posts: every step of both links goes through a slot.
Longer cycles (a ring of three or more stages) cannot be seen from one process:
``depth="auto"`` is for stage graphs without cycles (docs/pp-auto.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from syncless._core.errors import TransportFailedError

#: The fewest slots an auto link keeps: with 1, a slot step after a slot step would always wait for the copy-out
#: of the step before it, and the slot path would be no faster than a rendezvous.
MIN_SLOTS = 2
MAX_SLOTS = 64


def entry_value(step: int) -> int:
    """W at the start of recv(``step``): the persistent tensors are free for it, every slot of an earlier step too."""
    return 2 * step - 1


def copied_out_value(step: int) -> int:
    """W after the copy-out of slot step ``step``: its slot is free."""
    return 2 * step


def direct_wait_value(step: int) -> int:
    """What a direct step waits for in W (the receiver's stream reached recv(``step``))."""
    return 2 * step - 1


def slot_wait_value(step: int, slots: int) -> int | None:
    """What a slot step waits for in W (its slot's last user is done), or None: the first ``slots`` steps never wait."""
    return 2 * (step - slots) if step > slots else None


def choose_direct(step: int, posted: int, direct_possible: bool, nbytes: int, min_nbytes: int) -> bool:
    """Return whether step ``step`` goes straight into the persistent tensors (else through a slot).

    Direct only where the receiver shared its persistent tensors, where its host already posted recv(``step``)
    (``posted``, the last step it posted; see the module docstring for why), and for steps of at least
    ``min_nbytes`` bytes (``SYNCLESS_PP_AUTO_DIRECT_MIN_BYTES``).
    """
    # A step of no bytes has no copy-out to save, only the rendezvous to pay: it goes through a slot.
    return direct_possible and posted >= step and nbytes > 0 and nbytes >= min_nbytes


class PostedLog:
    """The sender's record of the receiver's "posted recv(N)" messages; refuses what the protocol cannot produce.

    The receiver posts 1, 2, 3, ... once each, at the start of each recv(). Posting N+1 needs recv(N) to have
    read step N's metadata, which send(N) writes; so while this stage is about to send step S, the values
    posted so far are at most S. A value that is not the next one (a replay, a gap, garbage) or that runs
    ahead of the steps sent is a protocol error, never trusted.
    """

    __slots__ = ("posted", "_who")

    def __init__(self, who: str):
        self.posted = 0
        self._who = who

    def accept(self, values: Sequence[int], sending_step: int) -> int:
        """Take the values read since the last call while about to send ``sending_step``; return the last posted.

        Raises:
            TransportFailedError: a value out of order (replayed, skipped, garbage) or ahead of the steps sent.
        """
        posted = self.posted
        for value in values:
            if value != posted + 1 or value > sending_step:
                why = "ahead of the steps sent" if value == posted + 1 else f"expected {posted + 1}"
                raise TransportFailedError(
                    f"{self._who}: the next stage posted recv({value}) while step {sending_step} is being sent "
                    f"({why}; protocol error: a corrupted or foreign peer). This transport is unusable: close() "
                    "or abort() it"
                )
            posted = value
        self.posted = posted
        return posted


class SendPlan:
    """Where one auto send runs and its events, chosen before anything is enqueued (so a failure knows them)."""

    __slots__ = ("caller", "direct", "enqueued", "post", "pre", "ready", "stream", "waited")

    def __init__(self, direct: bool, caller: int, stream: int, pre: Any, post: Any, ready: Any, waited: Any):
        self.direct = direct
        self.caller = caller
        self.stream = stream
        self.pre, self.post, self.ready, self.waited = pre, post, ready, waited
        self.enqueued = False  # something is on `stream` (a failure must then watch and fence it)

    @property
    def relayed(self) -> bool:
        return not self.direct


class AutoSender:
    """The GPU part of an auto send: the two paths, their waits, and the order of steps across streams.

    Args:
        hot: the driver calls (``_driver.Hot``, or the CPU tests' simulation).
        acquire_event: returns a free event.
        slots: D, the receiver's slot count.
        peer_slots: the address of each of the receiver's slots, as mapped here.
        targets: the receiver's persistent tensors as mapped here (one address per tensor, in layout
            order), or None where direct steps are impossible on this link.
        peer_full: the receiver's ``full`` flag, as mapped here.
        own_w: this stage's ``W`` (``empty``) flag, which the receiver writes.
        relay: the relay stream slot steps run on.
        sent: the event recorded after every step's ``full`` write.
        min_nbytes: the smallest step that may go direct.
    """

    def __init__(self, hot: Any, acquire_event: Callable[[], Any], *, slots: int, peer_slots: Sequence[int],
                 targets: Sequence[int] | None, peer_full: int, own_w: int, relay: int, sent: Any, min_nbytes: int):
        if slots < MIN_SLOTS:
            raise ValueError(f"an auto link keeps at least {MIN_SLOTS} slots; got {slots}")
        self.hot = hot
        self.acquire_event = acquire_event
        self.slots = slots
        self.peer_slots = list(peer_slots)
        self.targets = list(targets) if targets is not None else None
        self.peer_full = peer_full
        self.own_w = own_w
        self.relay = relay
        self.sent = sent
        self.min_nbytes = min_nbytes
        self.last_stream: int | None = None  # where the last step's `full` write went

    @property
    def direct_possible(self) -> bool:
        return self.targets is not None

    def choose(self, step: int, posted: int, nbytes: int) -> bool:
        """Return whether step ``step`` goes direct (see :func:`choose_direct`)."""
        return choose_direct(step, posted, self.targets is not None, nbytes, self.min_nbytes)

    def destinations(self, step: int, direct: bool, offsets: Sequence[int]) -> list[int]:
        """Return each tensor's destination: its persistent tensor (direct), or its offset in slot (step-1) % D."""
        if direct:
            if self.targets is None:
                raise ValueError("a direct step on a link whose receiver shared no persistent tensors")
            return self.targets
        slot = self.peer_slots[(step - 1) % self.slots]
        return [slot + offset for offset in offsets]

    def plan(self, direct: bool, caller: int) -> SendPlan:
        """Take the events of one step (enqueues nothing). ``caller``: the caller's current stream."""
        acquire = self.acquire_event
        pre, post = acquire(), acquire()
        if direct:
            return SendPlan(True, caller, caller, pre, post, None, None)
        return SendPlan(False, caller, self.relay, pre, post, acquire(), acquire())

    def enqueue(self, plan: SendPlan, step: int, copies: list[tuple[int, int, int]]) -> None:
        """Enqueue step ``step``'s GPU part as ``plan`` says; never blocks the host.

        ``copies``: ``(destination, source, nbytes)`` per tensor with bytes, destinations from
        :meth:`destinations`. Raises whatever a driver call raises, with ``plan.enqueued`` telling
        whether part of the step is on ``plan.stream``.
        """
        hot, stream = self.hot, plan.stream
        if self.last_stream is not None and self.last_stream != stream:
            # In order across streams: this step's copies and `full` write come after the previous step's
            # `full` write (recorded as `sent` on its stream), so `full` only grows and step N never lands
            # before step N-1. Waited for before `pre`, so the watchdog's clock counts only this step's wait.
            hot.wait_event(self.sent, stream)
        hot.record(plan.pre, stream)
        plan.enqueued = True
        if plan.direct:
            # The receiver's stream reached recv(step): its readers of step-1 (and any copy-out) are done.
            hot.wait_geq(stream, self.own_w, direct_wait_value(step))
        else:
            need = slot_wait_value(step, self.slots)
            if need is not None:
                # The slot's last user (step - D) is copied out; see the module docstring.
                hot.wait_geq(stream, self.own_w, need)
            # The receiver's flag first, the caller's work second (as depth >= 1 does): the flag wait runs
            # while the caller's stream is still busy, and once its work is done only the copies are left.
            hot.record(plan.waited, stream)
            hot.record(plan.ready, plan.caller)
            hot.wait_event(plan.ready, stream)
        hot.memcpy_all(copies, stream)
        hot.write(stream, self.peer_full, step)
        hot.record(self.sent, stream)
        hot.record(plan.post, stream)
        if not plan.direct:
            # The caller's later work (a later overwrite of the sources, the next step) waits for the copies.
            hot.wait_event(plan.post, plan.caller)
        self.last_stream = stream


class AutoReceiver:
    """The GPU part of an auto recv: the entry write, then the half the step's path needs.

    Args:
        hot: the driver calls.
        slots: the address of each of this stage's slots.
        targets: this stage's persistent tensors (one address per tensor, in layout order).
        own_full: this stage's ``full`` flag.
        peer_w: the sender's ``W`` flag, as mapped here.
        received: the event recorded after each step's last W write.
    """

    def __init__(self, hot: Any, *, slots: Sequence[int], targets: Sequence[int], own_full: int, peer_w: int,
                 received: Any):
        self.hot = hot
        self.slots = list(slots)
        self.targets = list(targets)
        self.own_full = own_full
        self.peer_w = peer_w
        self.received = received
        self.last_stream: int | None = None

    def enter(self, step: int, stream: int) -> None:
        """Enqueue on ``stream`` the entry of recv(``step``): ``W = 2*step - 1``. Never blocks the host.

        Called before the step's metadata is read (its path is not known yet), and before this stage
        posts recv(``step``) to the sender, so a direct step's wait always points at a write already enqueued.
        """
        hot = self.hot
        if self.last_stream is not None and self.last_stream != stream:
            # W only grows: this write comes after the previous recv()'s last W write (`received`).
            hot.wait_event(self.received, stream)
        hot.write(stream, self.peer_w, entry_value(step))
        self.last_stream = stream

    def finish(self, step: int, direct: bool, spans: Sequence[tuple[int, int]], stream: int, pre: Any,
               post: Any) -> None:
        """Enqueue on ``stream`` (the one :meth:`enter` used) the rest of recv(``step``). Never blocks the host.

        Direct: wait for the data, which the sender copied into the persistent tensors. Slot: wait, copy
        the slot out into the persistent tensors, free it (``W = 2*step``). ``spans``: ``(offset, nbytes)``
        per tensor in the slot (``_layout.dense_spans``).
        """
        hot = self.hot
        hot.record(pre, stream)
        hot.wait_geq(stream, self.own_full, step)
        if not direct:
            slot = self.slots[(step - 1) % len(self.slots)]
            for target, (offset, nbytes) in zip(self.targets, spans):
                if nbytes:
                    hot.memcpy(target, slot + offset, nbytes, stream)
        # W = 2N after either path: a slot step's copy-out is done; a direct step used no slot, and every
        # slot of an earlier step was free at its entry. Without this write after a direct step, slot step
        # N+D waited for recv(N+1)'s entry: the receiver's next call, and its stream past the readers of
        # step N (found in review: a two-link exchange then deadlocked where depth=D works).
        hot.write(stream, self.peer_w, copied_out_value(step))
        hot.record(self.received, stream)
        hot.record(post, stream)
