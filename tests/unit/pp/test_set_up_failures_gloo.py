"""Set-up failures that must say what happened, and rebuilds that must not pile up, on CPU ranks over gloo.

Each test spawns its ranks with a hard timeout (support.ranks) and prints progress. (Stages passing
different arguments and a malformed ``persistent`` are in ``test_make_arguments.py``.)
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from support.ranks import run_ranks

_spec = importlib.util.spec_from_file_location("pp_cases", pathlib.Path(__file__).with_name("pp_cases.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.timeout(120)


def test_a_peer_that_never_calls_make_transport_gives_a_peer_timeout_within_the_bound():
    timeout_s = 1.0
    name, is_peer_timeout, message, took = run_ranks(cases.peer_never_arrives, 2, args=(timeout_s,), timeout_s=60)[0]
    assert is_peer_timeout, (name, message)
    assert "private gloo group within 1 s" in message and "ranks [0, 1]" in message
    assert took <= timeout_s + 2.0, took


def test_rebuilding_sixty_times_keeps_threads_and_open_files_flat():
    results = run_ranks(cases.rebuild_rounds, 2, args=(60,), timeout_s=100)
    for (threads_0, fds_0), (threads_n, fds_n) in results:
        assert threads_n <= threads_0 + 2 and fds_n <= fds_0 + 4, results
