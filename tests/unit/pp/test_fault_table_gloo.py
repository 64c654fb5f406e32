"""The gloo rows of the fault table that CI runs: a fault in one CPU stage, what the other one sees, and a rebuild.

Each row spawns its ranks through the one launcher with a hard deadline and
prints progress; the whole table (all gloo rows, all GPU rows) is
``tests/multi_gpu/pp/fault_table.py``, run as a script.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "fault_table", pathlib.Path(__file__).parents[2] / "multi_gpu" / "pp" / "fault_table.py"
)
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

pytestmark = pytest.mark.timeout(150)

TIMEOUT_S = 3.0  # set-up exchanges must meet within it: on two busy CI cores 2 s is tight


@pytest.mark.parametrize(
    "fault, phase",
    [
        ("sigkill", "between"),  # the receiver dies between steps: the sender's next sends raise
        ("sigint", "step:before_meta"),  # the sender is interrupted inside a step: the receiver raises
        ("stall", "setup:layout"),  # a stage stalls in set-up past the timeout: the other's set-up raises
        ("sigint", "close"),  # an interrupted close() is resumed by the second call
    ],
)
def test_gloo_fault_row(fault, phase):
    row = table.run_row({"device": "cpu", "transport": "torch_distributed", "fault": fault, "phase": phase},
                        TIMEOUT_S, steps=200)
    print(row.get("ranks"))
    assert row["verdict"] == "ok", row["problems"]
    survivor = row["ranks"][1 - table.VICTIM[phase]]
    if phase != "close":
        assert survivor["is_transport_error"], survivor
    assert row["seconds"] <= TIMEOUT_S + table.SLACK_S
    assert row["rebuild"] == "200 steps bit-exact"


def test_rows_cover_every_fault_and_phase_of_both_transports():
    rows = table.rows_for("cuda", ["copy_engine", "torch_distributed"], list(table.FAULTS), None)
    phases = {(r["transport"], r["phase"]) for r in rows}
    assert {p for t, p in phases if t == "copy_engine"} == set(table.SETUP_PHASES_CE + table.STEP_PHASES)
    assert {p for t, p in phases if t == "torch_distributed"} == set(table.SETUP_PHASES_TD + table.STEP_PHASES)
    assert len(rows) == 3 * (len(table.SETUP_PHASES_CE) + len(table.SETUP_PHASES_TD) + 2 * len(table.STEP_PHASES))


@pytest.mark.parametrize("fault", list(table.SETUP_FAULTS))
def test_gloo_set_up_row(fault):
    row = table.run_row({"device": "cpu", "transport": "torch_distributed", "fault": fault,
                         "phase": table.SETUP_PHASE}, TIMEOUT_S, steps=50)
    print(row.get("ranks"))
    assert row["verdict"] == "ok", row["problems"]
    assert row["survivor_raised"].startswith(table.SETUP_FAULTS[fault])
    assert row["rebuild"] == "50 steps bit-exact"


def test_set_up_rows_are_in_the_table_for_both_transports():
    rows = table.rows_for("cuda", ["copy_engine", "torch_distributed"], [*table.FAULTS, *table.SETUP_FAULTS], None)
    setup = {(r["transport"], r["fault"]) for r in rows if r["phase"] == table.SETUP_PHASE}
    assert setup == {(t, f) for t in ("copy_engine", "torch_distributed") for f in table.SETUP_FAULTS}
