"""switches.read_switch: the README's switch values, in any case and spacing, and nothing else."""
import pytest

from m3_eagle_plugin.switches import read_switch

NAME = "M3_EAGLE_TEST_SWITCH"


@pytest.mark.parametrize("raw, on", [("1", True), (" TRUE ", True), ("Yes", True), ("on", True),
                                     ("0", False), ("false", False), (" No", False), ("OFF", False), ("", False)])
def test_documented_values_read_as_documented(raw, on):
    assert read_switch(NAME, {NAME: raw}) == (on, None)


def test_unset_is_off():
    assert read_switch(NAME, {}) == (False, None)


@pytest.mark.parametrize("raw", ["2", "force", "enable", "-1", "yes!", "1 1"])
def test_other_values_are_off_and_named(raw):
    on, problem = read_switch(NAME, {NAME: raw})
    assert on is False
    assert problem.startswith(f"{NAME}={raw!r} is not a valid switch") and "1 or 0" in problem
