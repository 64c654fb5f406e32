"""The CPU side of a pipeline group in one process: side groups, tags, agree(), barrier, metadata.

torch.distributed's collectives are replaced by stand-ins that play the
other ranks' parts; what is under test is the bookkeeping and the outcome
every rank must reach.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support.gloo_stand_in import gather_as_gloo
from syncless._core.errors import CopyEngineUnavailable, PeerTimeoutError, TransportSetupError
from syncless.pp import _group
from syncless.pp import _wire as wire
from syncless.pp._group import StageMap, agree, barrier, cpu_group, recv_meta

TIMEOUT_S = 7.75  # an unusual value, so cache keys are this file's own


@pytest.fixture
def registry(monkeypatch):
    """torch's registry of group names (group -> name), this process's own for the test."""
    names: dict = {}
    monkeypatch.setattr(_group, "_group_names", lambda: names)
    return names


@pytest.fixture
def groups(monkeypatch, registry):
    """Making a private group hands out numbered stand-ins, registers them as torch does, records the calls."""
    made = []

    def new_side_group(members, name, timeout_s):
        made.append({"ranks": members, "name": name, "timeout_s": timeout_s})
        group = f"group {len(made)}"
        registry[group] = name
        return group

    monkeypatch.setattr(_group, "_new_side_group", new_side_group)
    return made


class _FailingWork:
    def wait(self, timeout=None):
        raise RuntimeError("[fake gloo] connection closed by peer")


def test_only_the_first_stage_has_no_previous_and_only_the_last_no_next():
    ranks = (3, 1, 2)
    assert [StageMap(ranks, i).prev_rank for i in range(3)] == [None, 3, 1]
    assert [StageMap(ranks, i).next_rank for i in range(3)] == [1, 2, None]


def test_every_transport_gets_a_new_side_group_never_a_cached_one(groups):
    # After a failure only some ranks may know a group is broken; a cache would hand those a new group
    # and the others the broken one. So every call makes a group, in the same order on every rank.
    first = cpu_group([2, 0, 1], TIMEOUT_S)
    second = cpu_group([0, 1, 2], TIMEOUT_S)
    assert first != second and len(groups) == 2
    assert groups[0]["ranks"] == [0, 1, 2]  # the stage order does not matter
    assert groups[0]["timeout_s"] == TIMEOUT_S
    assert cpu_group([0, 1, 2], TIMEOUT_S) not in (first, second)
    assert [g["name"] for g in groups] == ["syncless_pp:0,1,2:0", "syncless_pp:0,1,2:1", "syncless_pp:0,1,2:2"]


def test_a_side_groups_name_counts_only_the_private_groups_over_the_same_ranks(groups, registry):
    # A link back (docs/pp.md) makes groups on the end stages only: the caller's new_group([0, 2]) and
    # the link back's private group. The middle stage holds neither, so a name that counted every group
    # (torch's own) would differ between the stages of the rebuilt forward transport.
    cpu_group([0, 1, 2], TIMEOUT_S)
    registry["the caller's ends group"] = "7"
    cpu_group([2, 0], TIMEOUT_S)  # the link back
    cpu_group([0, 12], TIMEOUT_S)  # another group whose ranks begin alike
    assert cpu_group([1, 0, 2], TIMEOUT_S) is not None
    assert [g["name"] for g in groups] == [
        "syncless_pp:0,1,2:0", "syncless_pp:0,2:0", "syncless_pp:0,12:0", "syncless_pp:0,1,2:1"]


def test_a_destroyed_or_failed_side_groups_name_is_never_given_again(groups, registry, monkeypatch):
    first = cpu_group([0, 1], TIMEOUT_S)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group: registry.pop(group))
    _group.release_cpu_group(first, "close")
    assert first not in registry and list(registry.values()) == ["syncless_pp:0,1:0"]  # held by a retired name

    def no_rendezvous(members, name, timeout_s):
        groups.append({"ranks": members, "name": name, "timeout_s": timeout_s})
        raise RuntimeError("Wait timeout")

    with monkeypatch.context() as failing:
        failing.setattr(_group, "_new_side_group", no_rendezvous)
        with pytest.raises(PeerTimeoutError):
            cpu_group([0, 1], TIMEOUT_S)
    cpu_group([0, 1], TIMEOUT_S)
    assert [g["name"] for g in groups] == ["syncless_pp:0,1:0", "syncless_pp:0,1:1", "syncless_pp:0,1:2"]


def _gather_as_gloo(monkeypatch, others):
    """gloo's all_gather played here (``others``: global rank -> its encoded message); returns what this rank sends."""
    return gather_as_gloo(monkeypatch, others, MY_RANK)


def _others(monkeypatch, outcomes):
    """Make the gather deliver ``outcomes`` (global rank -> (status, value)) for the other ranks."""
    _gather_as_gloo(monkeypatch, {
        rank: wire.encode({"rank": rank, "status": status, "value": value})
        for rank, (status, value) in outcomes.items()
    })


MY_RANK = 0
STAGES = StageMap((2, 0, 1), 1)  # pipeline order differs from rank order; this process is rank 0


def test_agree_returns_every_stages_result_in_pipeline_order(monkeypatch):
    _others(monkeypatch, {1: (None, "from rank 1"), 2: (None, "from rank 2")})
    assert agree("side", STAGES, "set-up", lambda: "from rank 0") == ["from rank 2", "from rank 0", "from rank 1"]


def test_agree_raises_the_first_failure_in_pipeline_order(monkeypatch):
    _others(monkeypatch, {1: (("ValueError", "bad depth"), None), 2: (("error", "RuntimeError: boom"), None)})
    with pytest.raises(RuntimeError, match=r"set-up failed on stage 0 \(rank 2\): RuntimeError: boom") as info:
        agree("side", STAGES, "set-up", lambda: 1)
    assert type(info.value) is TransportSetupError


@pytest.mark.parametrize("error", [ValueError("depth must be >= 1"), TypeError("depth must be an int")])
def test_a_bad_argument_here_is_the_same_error_type_on_every_rank(monkeypatch, error):
    sent = _gather_as_gloo(monkeypatch, {
        rank: wire.encode({"rank": rank, "status": None, "value": rank}) for rank in (1, 2)
    })

    def local():
        raise error

    with pytest.raises(type(error)) as info:
        agree("side", STAGES, "make_transport", local)
    assert type(info.value) is type(error) and info.value.__cause__ is error
    assert str(info.value) == f"make_transport failed on stage 1 (rank 0): {error}"
    # What the other ranks receive turns into the same exception there.
    status = wire.decode(sent[-1])["status"]
    there = _group.first_failure([None, status, None], STAGES, "make_transport")
    assert type(there) is type(error) and str(there) == str(info.value)


def test_an_unavailable_copy_engine_is_shared_as_unavailable(monkeypatch):
    _others(monkeypatch, {1: (None, 1), 2: (None, 2)})

    def local():
        raise CopyEngineUnavailable("no NVLink between GPU 0 and GPU 1")

    with pytest.raises(CopyEngineUnavailable, match="stage 1 \\(rank 0\\): no NVLink"):
        agree("side", STAGES, "set-up", local)


def test_a_failed_exchange_raises_peer_timeout(groups, monkeypatch):
    side = cpu_group([0, 1, 2], TIMEOUT_S)

    def all_gather(out, mine, group=None):
        raise RuntimeError("[fake gloo] rank 2 closed the connection")

    monkeypatch.setattr(dist, "all_gather", all_gather)
    with pytest.raises(PeerTimeoutError, match="exchanging set-up outcomes"):
        agree(side, STAGES, "set-up", lambda: 1)


def test_barrier_says_whether_every_rank_arrived(groups, monkeypatch):
    side = cpu_group([0, 1], TIMEOUT_S)

    class _Done:
        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, async_op=False: _Done())
    assert barrier(side, TIMEOUT_S, "close") is True
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, async_op=False: _FailingWork())
    assert barrier(side, TIMEOUT_S, "close") is False


def test_metadata_that_never_comes_raises_peer_timeout(groups, monkeypatch):
    side = cpu_group([0, 1], TIMEOUT_S)
    monkeypatch.setattr(dist, "irecv", lambda tensor, src=None, group=None, tag=0: _FailingWork())
    with pytest.raises(PeerTimeoutError, match="rank 1 sent nothing within 7.75 s"):
        recv_meta(side, 1, 1000, 3, TIMEOUT_S, "stage 1 receiving step 4")



@pytest.mark.parametrize("raw", ["Wait timeout", "Gloo connectFullMesh failed with [...] Connection refused"])
def test_a_side_group_whose_peer_never_joins_raises_a_peer_timeout_naming_the_ranks(monkeypatch, registry, raw):
    def new_side_group(members, name, timeout_s):
        raise RuntimeError(raw)  # what torch raises when a stage never reaches its rendezvous

    monkeypatch.setattr(_group, "_new_side_group", new_side_group)
    with pytest.raises(PeerTimeoutError, match=r"ranks \[0, 1\] did not all join .* within 5 s") as info:
        cpu_group([1, 0], 5.0)
    assert raw in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


GLOO_SAID = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
             "7750ms for recv operation to complete")


def test_a_peer_timeout_keeps_what_gloo_said_without_its_build_path(groups, monkeypatch):
    class _TimedOut:
        def wait(self, timeout=None):
            raise RuntimeError(GLOO_SAID)

    side = cpu_group([0, 1], TIMEOUT_S)
    monkeypatch.setattr(dist, "irecv", lambda tensor, src=None, group=None, tag=0: _TimedOut())
    with pytest.raises(PeerTimeoutError) as info:
        recv_meta(side, 1, 1000, 3, TIMEOUT_S, "stage 1 receiving step 4")
    text = str(info.value)
    assert "/__w/" not in text and "unbound_buffer.cc" not in text
    assert text.endswith(": Timed out waiting 7750ms for recv operation to complete")
    assert "[127.0.0.1]:4242." in _group.peer_error_text(RuntimeError(
        "[/__w/pytorch/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242."))
