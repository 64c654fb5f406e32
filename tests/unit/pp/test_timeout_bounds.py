"""Pipeline timeouts are bounded: 0.1 s to one day, from the environment and from make_transport alike."""

from __future__ import annotations

import pytest

from syncless._core import config
from syncless._core.errors import ConfigError


@pytest.mark.parametrize("text", ["1e-300", "0.05", "0", "-1", "86401", "1e300", "inf", "nan", "soon"])
def test_out_of_bounds_environment_values_name_the_variable_and_the_bounds(text):
    # Before: 1e-300 was accepted (the host would poll its peer in a busy loop) and 1e300 overflowed later.
    with pytest.raises(ConfigError, match="SYNCLESS_PP_TIMEOUT_S") as info:
        config.read("SYNCLESS_PP_TIMEOUT_S", {"SYNCLESS_PP_TIMEOUT_S": text})
    assert "0.1 to 86400" in str(info.value) and repr(text) in str(info.value)


@pytest.mark.parametrize("text, seconds", [("0.1", 0.1), ("3", 3.0), ("86400", 86400.0)])
def test_the_bounds_themselves_are_allowed(text, seconds):
    assert config.read("SYNCLESS_PP_TIMEOUT_S", {"SYNCLESS_PP_TIMEOUT_S": text}) == seconds


@pytest.mark.parametrize("value", [1e-300, 0.09, 86400.5, float("inf"), float("nan"), True, "3", None])
def test_explicit_values_are_checked_the_same_way(value):
    with pytest.raises(ConfigError, match="timeout_s"):
        config.check_pp_timeout(value, "timeout_s")
    assert isinstance(ConfigError("x"), ValueError)  # callers catching ValueError still do
