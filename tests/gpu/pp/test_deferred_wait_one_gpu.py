"""``recv(wait=False)`` against ``recv()`` with input preparation in between: two stages on cuda:0.

The measurement of issue 25 item 2: per step both stages start together; the receiver calls recv()
(or recv(wait=False)), queues input preparation (a sleep kernel of about the transfer's length),
then reads the data. With recv() the stream waits for the data before the preparation; deferred,
the preparation overlaps the transfer. Prints both timings (run with -s, or read the progress lines).
The test checks the data only; the timings are a measurement (committed under bench/results/), never
asserted: speed is not a pass/fail property of a test.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_spec = importlib.util.spec_from_file_location(
    "pp_cases", pathlib.Path(__file__).parents[2] / "unit" / "pp" / "pp_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(200)]


@pytest.mark.parametrize("depth", [2, 0, "auto"])
def test_deferred_wait_overlaps_input_preparation_with_the_transfer(depth):
    result = run_ranks(cases.deferred_wait_timing, 2, args=(depth,), devices=[0, 0], timeout_s=150)[1]
    assert result["mismatches"] == 0, result
    now, deferred = result["recv()"]["gpu_us"], result["recv(wait=False)"]["gpu_us"]
    print(f"deferred-wait depth={depth}: recv() {now:.1f} us, recv(wait=False) {deferred:.1f} us "
          f"({deferred / now:.2f}x); {result}")
