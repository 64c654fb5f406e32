"""Layouts and step validation: plain logic on the CPU."""

from __future__ import annotations

import pytest
import torch

from syncless.pp._layout import (
    ABSENT,
    SLOT_ALIGN_BYTES,
    Layout,
    Ring,
    StepCheck,
    TensorSpec,
    check_depth,
    dense_spans,
    persistent_device,
    specs_from_persistent,
    validate_step,
)


def _persistent():
    return {
        "hidden": torch.empty(7, 5, dtype=torch.bfloat16),
        "stats": torch.empty(7, 3, 2, dtype=torch.float32),
        "ids": torch.empty(9, dtype=torch.int64),
    }


def test_layout_slots_are_aligned_disjoint_and_in_order():
    specs = specs_from_persistent(_persistent())
    layout = Layout.from_specs(specs)
    assert layout.names == ["hidden", "stats", "ids"]
    ends = []
    for name in layout.names:
        offset = layout.offsets[name]
        assert offset % SLOT_ALIGN_BYTES == 0
        assert all(offset >= end for end in ends)
        ends.append(offset + specs[name].nbytes)
    assert specs["hidden"].nbytes == 7 * 5 * 2
    assert specs["stats"].row_nbytes == 3 * 2 * 4
    assert specs["ids"].row_shape == () and specs["ids"].nbytes == 9 * 8
    assert layout.nbytes >= max(ends) and layout.nbytes % SLOT_ALIGN_BYTES == 0


def test_empty_layout_still_has_bytes():
    assert Layout.from_specs({}).nbytes == SLOT_ALIGN_BYTES


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_ring_slots_are_aligned_disjoint_copies_of_the_layout(depth):
    specs = specs_from_persistent(_persistent())
    layout = Layout.from_specs(specs)
    ring = Ring(layout, depth)
    assert ring.stride == layout.nbytes and ring.nbytes == depth * layout.nbytes
    spans = []
    for k in range(depth):
        start = ring.slot_offset(k)
        assert start == k * layout.nbytes and start % SLOT_ALIGN_BYTES == 0
        for name in layout.names:
            begin = start + layout.offsets[name]
            assert begin % SLOT_ALIGN_BYTES == 0
            spans.append((begin, begin + specs[name].nbytes))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # nothing overlaps
    assert spans[0][0] == 0 and spans[-1][1] <= ring.nbytes
    # Steps 1, 2, ... take the slots in turn; step N and N + depth share one.
    assert [ring.slot(step) for step in range(1, 2 * depth + 2)] == [*range(depth), *range(depth), 0]
    with pytest.raises(ValueError, match=rf"slot must be in \[0, {depth}\); got {depth}"):
        ring.slot_offset(depth)


def test_ring_of_an_empty_layout_still_has_a_slot_each():
    assert Ring(Layout.from_specs({}), 3).nbytes == 3 * SLOT_ALIGN_BYTES


def test_ring_bytes_for_a_large_activation():
    # 256 rows of 8192 bf16 = 4 MiB per slot; depth 2 holds 8 MiB.
    specs = {"hidden": TensorSpec(torch.bfloat16, (8192,), 256)}
    ring = Ring(Layout.from_specs(specs), 2)
    assert ring.slot_offset(1) == 4 << 20 and ring.nbytes == 8 << 20


@pytest.mark.parametrize("good", [0, 1, 2, 7])
def test_check_depth_accepts_non_negative_ints(good):
    assert check_depth(good) == good


@pytest.mark.parametrize("bad, words", [(-2, "got -2"), (-1, "got -1"), (True, "got True"), (2.0, "got 2.0 (float)"),
                                        ("2", "got '2' (str)"), (None, "got None")])
def test_check_depth_rejects_the_rest_with_a_value_error(bad, words):
    with pytest.raises(ValueError, match="depth must be an int >= 0") as info:
        check_depth(bad)
    assert words in str(info.value)


def test_persistent_must_be_contiguous_tensors_with_rows():
    with pytest.raises(ValueError, match="contiguous"):
        specs_from_persistent({"x": torch.empty(4, 6).t()})
    with pytest.raises(ValueError, match="0-d"):
        specs_from_persistent({"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="Tensor"):
        specs_from_persistent({"x": [1, 2]})
    with pytest.raises(TypeError, match="dict"):
        specs_from_persistent([torch.empty(1)])
    assert specs_from_persistent(None) == {}


def test_persistent_device_rejects_mixed_devices():
    assert persistent_device({"a": torch.empty(1), "b": torch.empty(1)}) == torch.device("cpu")
    assert persistent_device({}) is None
    with pytest.raises(ValueError, match="one device"):
        persistent_device({"a": torch.empty(1), "b": torch.empty(1, device="meta")})


def _good_step(rows=3):
    return {
        "hidden": torch.randn(rows, 5).to(torch.bfloat16),
        "stats": torch.randn(rows, 3, 2),
        "ids": torch.randint(0, 100, (rows,)),
    }


def test_validate_step_returns_rows_and_accepts_zero_and_max():
    specs = specs_from_persistent(_persistent())
    cpu = torch.device("cpu")
    assert validate_step(specs, _good_step(3), cpu, "stage 1") == {"hidden": 3, "stats": 3, "ids": 3}
    step = _good_step(0)
    step["ids"] = torch.randint(0, 100, (9,))
    assert validate_step(specs, step, cpu, "stage 1") == {"hidden": 0, "stats": 0, "ids": 9}
    noncontiguous = _good_step(2)
    noncontiguous["stats"] = torch.randn(2, 2, 3).transpose(1, 2)
    assert validate_step(specs, noncontiguous, cpu, "stage 1")["stats"] == 2


def test_a_step_may_carry_any_subset_of_the_layout_keys():
    specs = specs_from_persistent(_persistent())
    cpu = torch.device("cpu")
    step = _good_step(3)
    del step["stats"]
    assert validate_step(specs, step, cpu, "stage 1") == {"hidden": 3, "ids": 3}
    assert validate_step(specs, {}, cpu, "stage 1") == {}
    check = StepCheck(specs, cpu, "stage 1")
    assert check.rows(step) == [3, ABSENT, 3]  # layout order, ABSENT for the key left out
    assert check.rows({}) == [ABSENT] * 3
    assert dense_spans([2, 4, 8], [3, ABSENT, 0]) == dense_spans([2, 4, 8], [3, 0, 0])
    with pytest.raises(TypeError, match=r"\['ids'\] must be a torch.Tensor"):
        check.rows({"ids": None})


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda s: (s.pop("ids"), s.update(extra=torch.zeros(1))), r"any subset of them\); unknown \['extra'\]"),
        (lambda s: s.update(extra=torch.zeros(1)), r"unknown \['extra'\]"),
        (lambda s: s.update(hidden=torch.randn(3, 5)), r"'hidden'.*expected dtype torch.bfloat16, got torch.float32"),
        (lambda s: s.update(stats=torch.randn(3, 2, 3)), r"'stats'.*expected shape \(rows, \*\(3, 2\)\), got \(3, 2, 3\)"),
        (lambda s: s.update(ids=torch.randint(0, 9, (10,))), r"'ids'.*expected at most 9 rows, got 10"),
        (lambda s: s.update(hidden=torch.empty(3, 5, dtype=torch.bfloat16, device="meta")), r"'hidden'.*expected a tensor on cpu, got one on meta"),
    ],
)
def test_validate_step_names_key_expected_and_got(mutate, pattern):
    specs = specs_from_persistent(_persistent())
    step = _good_step(3)
    mutate(step)
    with pytest.raises(ValueError, match=pattern):
        validate_step(specs, step, torch.device("cpu"), "stage 1 (rank 1)")


def test_validate_step_type_errors():
    specs = specs_from_persistent(_persistent())
    with pytest.raises(TypeError, match="dict"):
        validate_step(specs, [1], torch.device("cpu"), "stage 1")
    step = _good_step()
    step["ids"] = [1, 2]
    with pytest.raises(TypeError, match="'ids'"):
        validate_step(specs, step, torch.device("cpu"), "stage 1")


def test_a_stage_of_several_ranks_is_refused_with_the_tp_x_pp_pairing():
    from syncless.pp._group import resolve_stages

    with pytest.raises(ValueError, match=r"one global rank per stage; got \[0, 1\].*one per tensor-parallel rank"):
        resolve_stages([0, 1, 2, 3], 0, [[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="must hold ints"):
        resolve_stages([0, 1], 0, ["0", 1.5])
    with pytest.raises(TypeError, match="a list of global ranks"):
        resolve_stages([0, 1], 0, "01")
    assert resolve_stages([0, 2], 2, [2, 0]).index == 0  # one TP rank's pipeline group: ranks 2 -> 0
