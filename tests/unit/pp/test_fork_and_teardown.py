"""A forked child marks the parent's transports unusable; the tear-down order that never frees under a peer.

CPU only: a real fork; the tear-down over recorded callables. (That a forked child closes its copies of
the metadata sockets is tested with the channel, in ``test_meta_channel_attackers.py``.)
"""

from __future__ import annotations

import os

import pytest

from syncless.pp import _fork
from syncless.pp._teardown import Teardown

pytestmark = pytest.mark.timeout(60)


def test_a_forked_child_marks_registered_transports_unusable():
    class Stub:
        def __init__(self):
            self.forked = False

        def _forked(self):
            self.forked = True

    stub = Stub()
    _fork.forget_in_child(stub)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, b"1" if stub.forked else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_end, 1) == b"1"
    assert stub.forked is False  # the parent's own transport is untouched
    os.close(read_end)
    os.close(write_end)


class Log:
    def __init__(self):
        self.calls = []

    def __call__(self, name, result=None):
        def run(*args):
            self.calls.append(name)
            return result

        return run


def _made(log, barrier_ok=True):
    """What set-up makes, in its order: context, barrier, streams, buffer, socket, mappings."""
    teardown = Teardown()
    teardown.shared(log("release context"), nbytes=0, what="context")
    teardown.barrier(log("barrier", barrier_ok))
    teardown.local(log("destroy stream"))
    teardown.shared(log("free buffer"), nbytes=4096, what="buffer")
    teardown.local(log("close socket"))
    teardown.unmap(log("unmap peer"), what="peer buffer")
    return teardown


def test_everything_local_and_unmapped_first_then_the_barrier_then_the_frees():
    log = Log()
    teardown = _made(log)
    teardown.run(collective=True, gpu_idle=True)
    assert log.calls == ["unmap peer", "close socket", "destroy stream", "barrier", "free buffer", "release context"]
    assert teardown.finished and teardown.leaked_nbytes == 0


def test_a_failed_barrier_keeps_what_a_peer_may_map_and_reports_its_bytes():
    # Before: close() unmapped, barriered again and freed its buffer even after a failed barrier.
    log = Log()
    teardown = _made(log, barrier_ok=False)
    teardown.run(collective=True, gpu_idle=True)
    assert "free buffer" not in log.calls and "release context" not in log.calls
    assert teardown.leaked_nbytes == 4096 and any("buffer" in line for line in teardown.leaked)


def test_without_the_collective_or_an_idle_gpu_nothing_shared_is_freed():
    for collective, idle in ((False, True), (True, False)):
        log = Log()
        teardown = _made(log)
        teardown.run(collective=collective, gpu_idle=idle)
        assert "free buffer" not in log.calls
        assert ("barrier" in log.calls) == (collective and idle)  # entered only after unmapping: see below
        assert ("unmap peer" in log.calls) == idle  # a queued copy may still write through a mapping
        assert teardown.leaked_nbytes == 4096


def test_a_stage_that_left_a_peer_mapped_does_not_enter_the_barrier():
    # The barrier tells every stage that the others unmapped its buffer, so that it may free it. Before,
    # a stage whose GPU never went idle (close()'s drain gave up) left its mappings of the peers' buffers
    # in place, with copies into them maybe still queued, and entered the barrier anyway: the barrier
    # succeeded and the peers freed the buffers it still mapped and might still write.
    log = Log()
    teardown = _made(log)
    teardown.run(collective=True, gpu_idle=False)
    assert "unmap peer" not in log.calls and "barrier" not in log.calls  # the peers' barrier fails: they keep theirs
    assert teardown.finished and teardown.leaked_nbytes == 4096


def test_an_interrupted_teardown_resumes_and_never_reruns_a_step():
    # Before: close() set _closed first, so an interrupt in its first barrier skipped the unwinding
    # and a second close() did nothing.
    calls = []

    def interrupted_barrier():
        calls.append("barrier")
        raise KeyboardInterrupt

    teardown = Teardown()
    teardown.shared(lambda: calls.append("free"), nbytes=64, what="buffer")
    teardown.barrier(interrupted_barrier)
    teardown.local(lambda: calls.append("close socket"))
    with pytest.raises(KeyboardInterrupt):
        teardown.run(collective=True, gpu_idle=True)
    assert calls == ["close socket", "barrier"] and not teardown.finished
    teardown.run(collective=True, gpu_idle=True)
    assert calls == ["close socket", "barrier"]  # an interrupted barrier counts as failed: no free
    assert teardown.finished and teardown.leaked_nbytes == 64


def test_a_failing_release_does_not_stop_the_others_and_is_raised_after():
    calls = []

    def broken():
        raise RuntimeError("[fake driver] cuStreamDestroy failed")

    teardown = Teardown()
    teardown.local(lambda: calls.append("first made"))
    teardown.local(broken)
    teardown.local(lambda: calls.append("last made"))
    with pytest.raises(RuntimeError, match="cuStreamDestroy"):
        teardown.run(collective=True, gpu_idle=True)
    assert calls == ["last made", "first made"] and teardown.finished


def test_kept_tensors_stay_referenced():
    from syncless.pp import _teardown

    kept = object()
    teardown = Teardown()
    teardown.barrier(lambda: False)
    teardown.shared(lambda: None, nbytes=8, what="tensors", on_leak=lambda: _teardown.keep_forever(kept))
    teardown.run(collective=True, gpu_idle=True)
    assert any(obj is kept for obj in _teardown._KEPT)


def test_a_failed_set_up_reports_what_it_kept_on_the_error_it_raises():
    """A broken set-up exchange keeps the buffer a peer may map; the error make_transport raises says how much.

    (The GPU fault table read a failed set-up's survivor as +2 MiB "at baseline": nothing reported the bytes.)
    """
    from syncless._core.errors import PeerTimeoutError
    from syncless.pp._copy_engine_setup import _unwind

    log = Log()
    err = PeerTimeoutError("stage 1 sent nothing within 1 s")
    _unwind(_made(log), "copy-engine set-up", err, collective=False)
    assert "free buffer" not in log.calls and err.leaked_nbytes == 4096
    uniform = PeerTimeoutError("every stage failed alike")
    _unwind(_made(Log()), "copy-engine set-up", uniform, collective=True)
    assert uniform.leaked_nbytes == 0  # the barrier paired up: everything was freed
    interrupted = KeyboardInterrupt()  # a Ctrl-C in set-up says it too
    _unwind(_made(Log()), "copy-engine set-up", interrupted, collective=False)
    assert interrupted.leaked_nbytes == 4096
