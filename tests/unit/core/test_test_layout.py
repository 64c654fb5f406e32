"""Where GPU tests live: what needs two GPUs is under tests/multi_gpu, and scripts/gpu-session runs every suite."""

from __future__ import annotations

import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parents[2]
SESSION = TESTS.parent / "scripts" / "gpu-session"

# Not moved by this change (tests/gpu/bench belongs to the bench); it fails the same way on one GPU under
# SYNCLESS_REQUIRE_GPU=1 and is to move to tests/multi_gpu/bench.
_NOT_YET_MOVED: set[str] = set()  # every test that needs two GPUs is under tests/multi_gpu


def test_no_test_under_tests_gpu_needs_two_gpus():
    # tests/gpu runs on one GPU with SYNCLESS_REQUIRE_GPU=1 (scripts/gpu-session), where a multi_gpu test fails
    # instead of running: it belongs under tests/multi_gpu, which runs on two.
    needing_two = sorted(str(path.relative_to(TESTS)) for path in (TESTS / "gpu").rglob("*.py")
                         if re.search(r"mark\.multi_gpu", path.read_text()))
    assert [name for name in needing_two if name not in _NOT_YET_MOVED] == []


def _part(name: str) -> str:
    text = SESSION.read_text()
    start = text.index(f"\n  {name})")
    return text[start:text.index(";;", start)]


def test_the_one_gpu_verification_covers_every_one_gpu_suite_in_slots_sized_from_the_budget():
    # verify1 ran tests/gpu and tests/plugin in one fixed 330 s slot, shorter than the suite (it timed out after
    # 216 passed); its two parts each fit one device call, and their slots take what the budget leaves.
    first, second = _part("verify1"), _part("verify1-syncs")
    assert "tests/gpu" in first and "--ignore tests/gpu/syncs" in first and "--ignore tests/gpu/compat" in first
    assert "tests/gpu/syncs tests/gpu/compat tests/plugin" in second
    for part in (first, second):
        slots = re.findall(r'\brun gpu-\S+ ("[^"]*"|\S+)', part)
        assert slots and all(slot.startswith('"$(( $(left) -') for slot in slots), slots
