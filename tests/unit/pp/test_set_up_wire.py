"""Set-up messages between stages carry no pickles: the typed JSON format, its checks, and agree() over it.

The last test runs two real gloo ranks; one plays a hostile peer that sends a
pickle whose unpickling would create a file.
"""

from __future__ import annotations

import pickle
import random

import pytest
import torch
import torch.distributed as dist

from support.gloo_stand_in import gather_as_gloo
from support.ranks import run_ranks
from syncless._core.errors import CopyEngineUnavailable
from syncless.pp import _copy_engine_setup as setup
from syncless.pp import _group
from syncless.pp import _wire as wire
from syncless.pp._eligibility import StageDevice
from syncless.pp._group import StageMap, agree
from syncless.pp._layout import TensorSpec

pytestmark = pytest.mark.timeout(120)


def _random_export(rng):
    return setup._Export(
        rng.randbytes(64), "\0syncless-pp-1-" + rng.randbytes(8).hex(), rng.randbytes(32),
        [(rng.randint(-1, 5), rng.randint(0, 2**40)) for _ in range(rng.randint(0, 4))],
        [rng.randbytes(64) for _ in range(rng.randint(0, 3))],
    )


def test_every_value_set_up_exchanges_comes_back_equal_and_of_the_same_types():
    rng = random.Random(15)
    values = [
        None, True, 0, -(2**63), 2**64 - 1, 1.5, "", "stage ü", rng.randbytes(100),
        (1, "a", None), [1, [2, (3,)]], {"b": 1, "a": {"c": b"\0"}},
        StageDevice("node-7", "GPU-" + rng.randbytes(16).hex(), 3),
        ({"hidden": TensorSpec(torch.bfloat16, (8192,), 256), "ids": TensorSpec(torch.int64, (), 256)}, 2),
        _random_export(rng), setup._Export(rng.randbytes(64)),
        {"rank": 3, "status": ("unavailable", "no NVLink"), "value": None},
    ]
    for value in values:
        back = wire.decode(wire.encode(value))
        assert back == value and type(back) is type(value), value
        if isinstance(value, dict):
            assert list(back) == list(value)  # key order kept (the layout's slot order)
    export = wire.decode(wire.encode(_random_export(rng)))
    assert all(type(pair) is tuple for pair in export.targets)


@pytest.mark.parametrize("value, match", [
    (object(), "type object cannot cross"),
    ({1: "x"}, "string keys"),
    (float("nan"), "only finite"),
    (2**64, "does not fit in 64 bits"),
    (lambda: 0, "cannot cross"),
    ({"a": torch.zeros(2)}, "type Tensor cannot cross"),
    ("x" * (wire.MAX_MESSAGE_NBYTES + 1), "exceeds the limit"),
])
def test_values_that_cannot_cross_are_refused_when_encoding(value, match):
    with pytest.raises(wire.WireFormatError, match=match):
        wire.encode(value)


def _nested(depth):
    text = "1"
    for _ in range(depth):
        text = '{"list":[' + text + "]}"
    return text.encode()


def _export_tree(**changes):
    fields = {"buffer_handle": {"bytes": "ab" * 64}, "socket_name": None, "token": None, "targets": {"list": []},
              "target_handles": {"list": []}, "direct_problem": None}
    fields.update(changes)
    return ('{"record":"_Export","fields":' + __import__("json").dumps(fields) + "}").encode()


@pytest.mark.parametrize("data, match", [
    (pickle.dumps({"rank": 0}), "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "unexpected list"),
    (b'{"list": [1], "x": 2}', "extra keys"),
    (b"NaN", "NaN is not allowed"),
    (b"1e999", "not finite"),
    (b"123456789012345678901234567890", "does not fit in 64 bits"),
    (b'{"bytes": "zz"}', "not hexadecimal"),
    (b'{"dtype": "os.system"}', "is not a torch dtype"),
    (b'{"dict": [["a", 1], ["a", 2]]}', "new key"),
    (b'{"dict": [[1, 2]]}', "string key"),
    (b'{"object": "subprocess.Popen"}', "unexpected 'object' form"),
    (b'{"record": "Popen", "fields": {}}', "not a record type that can cross"),
    (b'{"record": "TensorSpec", "fields": {"dtype": {"dtype": "float32"}}}', "needs the fields"),
    ((b'{"record": "TensorSpec", "fields": {"dtype": {"dtype": "float32"}, "row_shape": {"list": [4]}, '
      b'"max_rows": 8}}'), "TensorSpec.row_shape must be a tuple"),
    ((b'{"record": "TensorSpec", "fields": {"dtype": {"dtype": "float32"}, "row_shape": {"tuple": [-4]}, '
      b'"max_rows": 8}}'), "TensorSpec.row_shape must be"),
    (b'{"record": "StageDevice", "fields": {"host": "h", "uuid": "u", "ordinal": true}}', "StageDevice.ordinal"),
    (_export_tree(buffer_handle={"bytes": "ab" * 63}), "_Export.buffer_handle must be 64 bytes"),
    (_export_tree(token={"bytes": "00" * 16}), "_Export.token must be None or 32 bytes"),
    (_export_tree(socket_name="/var/run/docker.sock"), "_Export.socket_name must be None or the abstract name"),
    (_export_tree(socket_name="\0other-service"), "_Export.socket_name must be"),
    (_export_tree(targets={"list": [{"tuple": [0, -5]}]}), "_Export.targets must be"),
    (_export_tree(direct_problem=7), "_Export.direct_problem must be None or a reason"),
    (_export_tree(direct_problem="x" * 5000), "_Export.direct_problem must be None or a reason"),
    (_nested(wire.MAX_DEPTH + 5), "deeper than"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON|unexpected"),
    (b" " * (wire.MAX_MESSAGE_NBYTES + 1), "exceeds the limit"),
])
def test_garbage_is_refused_with_what_is_wrong(data, match):
    with pytest.raises(wire.WireFormatError, match=match):
        wire.decode(data)


def test_random_bytes_never_decode_into_anything_but_plain_values():
    rng = random.Random(1515)
    for _ in range(2000):
        data = rng.randbytes(rng.randint(1, 64))
        try:
            value = wire.decode(data)
        except wire.WireFormatError:
            continue
        assert value is None or type(value) in (bool, int, float, str), value


# agree() over the wire -------------------------------------------------------------------

STAGES = StageMap((2, 0, 1), 1)  # this process is global rank 0, stage 1
MY_RANK = 0


def _gather(monkeypatch, others):
    """Stand in for gloo's all_gather: ``others`` maps global rank -> the bytes that rank sends."""
    gather_as_gloo(monkeypatch, others, MY_RANK)


def _message(rank, value, status=None):
    return wire.encode({"rank": rank, "status": status, "value": value})


def test_agree_returns_records_from_every_stage_in_pipeline_order(monkeypatch):
    rng = random.Random(7)
    exports = {rank: _random_export(rng) for rank in (0, 1, 2)}
    _gather(monkeypatch, {rank: _message(rank, exports[rank]) for rank in (1, 2)})
    assert agree("side", STAGES, "set-up", lambda: exports[0]) == [exports[2], exports[0], exports[1]]


@pytest.mark.parametrize("bad, match", [
    (pickle.dumps((2, None, "x")), "not valid JSON"),
    (b"\0" * 40, "not valid JSON"),
    (_message(1, None), "claims to come from rank 1"),
    (wire.encode({"rank": 2, "status": None}), r"not a \{rank, status, value\} dict"),
    (wire.encode({"rank": 2, "status": ("error",), "value": None}), "status is not None or a"),
    (wire.encode({"rank": 2, "status": None, "value": 5}), "it must be a str"),
])
def test_a_peers_garbage_raises_a_clear_error_naming_it(monkeypatch, bad, match):
    _gather(monkeypatch, {1: _message(1, "ok"), 2: bad})
    with pytest.raises(RuntimeError, match=match) as info:
        agree("side", STAGES, "set-up", lambda: "mine")
    assert "stage 0 (rank 2)" in str(info.value)


def test_a_length_out_of_bounds_is_refused_before_any_message_is_fetched(monkeypatch):
    calls = []

    def all_gather(out, mine, group=None):
        calls.append(mine.dtype)
        for slot, size in enumerate([len(bytes(8)), wire.MAX_MESSAGE_NBYTES + 1, 10]):
            out[slot].fill_(int(mine.item()) if slot == 0 else size)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    with pytest.raises(RuntimeError, match=r"stage 2 \(rank 1\) sent a set-up message .* length outside"):
        agree("side", STAGES, "set-up", lambda: "mine")
    assert calls == [torch.int64]  # no buffer of the announced size was made or gathered


def test_the_layout_check_of_make_transport_refuses_a_dict_of_something_else(monkeypatch):
    from syncless.pp._make import LAYOUT_CHECK

    mine = ({"x": TensorSpec(torch.float32, (4,), 8)}, 2)
    _gather(monkeypatch, {1: _message(1, mine), 2: _message(2, ({"x": 5}, 2))})
    with pytest.raises(RuntimeError, match=r"stage 0 \(rank 2\) .* must be a \(dict of name -> TensorSpec"):
        agree("side", STAGES, "make_transport", lambda: mine, check=LAYOUT_CHECK)


def test_a_result_that_cannot_cross_fails_on_every_rank_as_this_stages_error(monkeypatch):
    seen = {}
    _gather(monkeypatch, {1: _message(1, None), 2: _message(2, None)})
    original = _group._all_gather_bytes

    def spy(side_group, message, world, what):
        seen["mine"] = wire.decode(message)
        return original(side_group, message, world, what)

    monkeypatch.setattr(_group, "_all_gather_bytes", spy)
    with pytest.raises(RuntimeError, match=r"failed on stage 1 \(rank 0\): .*type object cannot cross"):
        agree("side", STAGES, "set-up", object)
    assert seen["mine"]["status"][0] == "WireFormatError"  # shared, so the other stages raise it too


def test_an_unavailable_status_still_becomes_copy_engine_unavailable(monkeypatch):
    _gather(monkeypatch, {1: _message(1, None), 2: _message(2, None, ("unavailable", "no NVLink"))})
    with pytest.raises(CopyEngineUnavailable, match=r"stage 0 \(rank 2\): no NVLink"):
        agree("side", STAGES, "set-up", lambda: None)


def test_a_huge_error_text_is_cut_so_it_still_crosses(monkeypatch):
    seen = {}
    _gather(monkeypatch, {1: _message(1, None), 2: _message(2, None)})
    original = _group._all_gather_bytes

    def spy(side_group, message, world, what):
        seen["nbytes"] = len(message)
        return original(side_group, message, world, what)

    monkeypatch.setattr(_group, "_all_gather_bytes", spy)

    def local():
        raise RuntimeError("x" * (4 * wire.MAX_MESSAGE_NBYTES))

    with pytest.raises(RuntimeError, match=r"\(cut\)"):
        agree("side", STAGES, "set-up", local)
    assert seen["nbytes"] < wire.MAX_MESSAGE_NBYTES


# A hostile peer over real gloo ------------------------------------------------------------


class _CreatesFile:
    """Unpickling this opens (creates) a file: what a hostile peer could make ``pickle.loads`` run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_peer(rank, world, marker):
    """Rank 1 sends a pickle in the framing all_gather_object used (sizes, then padded bytes); rank 0 agrees."""
    side = _group.cpu_group([0, 1], 30.0)
    if rank == 1:
        payload = pickle.dumps(_CreatesFile(marker))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=side)
        longest = max(int(t.item()) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(2)], mine, group=side)
        return "sent"
    try:
        agree(side, StageMap((0, 1), 0), "make_transport", lambda: ({}, 2))
    except RuntimeError as err:
        return str(err)
    return "accepted"


def test_a_hostile_peers_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "created-by-unpickling"
    results = run_ranks(hostile_peer, 2, args=(str(marker),), timeout_s=90)
    assert results[1] == "sent"
    assert "stage 1 (rank 1) sent a set-up message syncless cannot accept" in results[0], results[0]
    assert not marker.exists(), "the peer's pickle was unpickled"
