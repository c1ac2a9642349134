"""The PDL launch rule (`msa/kernels/pdl.py`): which launches get programmatic dependent launch.

The kernels' results with PDL on are checked on an SM90 GPU by the kernel tests themselves: their
small grids take the PDL path under the default rule."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import pdl  # noqa: E402
from m3_eagle_plugin.msa.kernels._common import KernelInputError  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(pdl, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(pdl, "device_sm_count", lambda device: 132)
    monkeypatch.delenv("M3_EAGLE_PDL", raising=False)


def _on(grid) -> bool:
    args = pdl.pdl_args(CUDA, grid)
    assert args["PDL"] == args["launch_pdl"]  # the kernel's wait and the launch attribute go together
    return args["PDL"]


def test_default_rule_is_small_grids_only(hopper):
    assert _on((1, 32)) and _on((1, 1, 64)) and _on((66,))
    assert not _on((67,)) and not _on((16, 64)) and not _on((64, 1, 4))


@pytest.mark.parametrize("value,small,large", [("0", False, False), ("1", True, False), ("all", True, True),
                                               ("", True, False), (" ALL ", True, True)])
def test_env_modes(hopper, monkeypatch, value, small, large):
    monkeypatch.setenv("M3_EAGLE_PDL", value)
    assert (_on((4, 16)), _on((1024, 16))) == (small, large)


def test_bad_env_value_names_the_allowed_ones(hopper, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_PDL", "yes")
    with pytest.raises(KernelInputError, match="M3_EAGLE_PDL='yes': expected one of 0, 1, all"):
        pdl.pdl_args(CUDA, (1,))


@pytest.mark.parametrize("capability", [None, (8, 0), (8, 9)])
def test_never_before_hopper_or_off_cuda(monkeypatch, capability):
    monkeypatch.setattr(pdl, "device_capability", lambda device: capability)
    monkeypatch.setenv("M3_EAGLE_PDL", "all")
    assert pdl.pdl_args(torch.device("cpu"), (1,)) == {"PDL": False, "launch_pdl": False}
    assert pdl.pdl_args(CUDA, (1,)) == {"PDL": False, "launch_pdl": False}


def test_property_rule_is_monotone_in_grid_size(hopper):
    """Growing a grid never turns PDL on; the threshold is half the SM count."""
    sizes = [1, 2, 3, 65, 66, 67, 131, 132, 133, 4096]
    flags = [_on((n,)) for n in sizes]
    assert flags == sorted(flags, reverse=True)
    assert all(_on((a, b)) == (a * b <= 66) for a in (1, 3, 16) for b in (1, 4, 22, 23))


def test_every_grid_is_on_for_any_size_unless_turned_off(hopper, monkeypatch):
    """A kernel that waits for its inputs itself (the hand-off top-k) asks for PDL on any grid;
    `M3_EAGLE_PDL=0` still wins."""
    assert pdl.pdl_args(CUDA, (4096, 16), every_grid=True) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("M3_EAGLE_PDL", "0")
    assert pdl.pdl_args(CUDA, (1,), every_grid=True) == {"PDL": False, "launch_pdl": False}
