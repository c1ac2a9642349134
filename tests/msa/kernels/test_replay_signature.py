"""What a replay signature (`replay.call_signature`) must tell apart: scalar arguments that are
equal as Python values but not to the ordinary path.

`False == 0` and `True == 1` (and `1 == 1.0`) hash alike, so a signature holding only the values
replays one's recording for the other, though `sparse_verify_step` reads `early is not False`
(`early=0` follows the measured rule, `early=False` never launches early) and an int-only argument
given as a float raises on the ordinary path. Checked on CPU with a stand-in kernel, as in
`test_replay.py`: the wrapper's own Python must run again for a scalar of another type, and its
result must be what that scalar asks for.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import launch as launch_mod, replay  # noqa: E402
from m3_eagle_plugin.msa.kernels.launch import launch  # noqa: E402
from m3_eagle_plugin.msa.kernels.replay import Replayer, call_signature  # noqa: E402


@dataclass(eq=False)
class Meta:
    kv_lens: torch.Tensor
    max_qo_len: int = 1


class AddKernel:
    """A stand-in kernel, `out = x + SHIFT`, invisible to the recorder as a GPU kernel is."""

    def __getitem__(self, grid):
        def run(x, out, *, SHIFT):
            with torch.utils._python_dispatch._disable_current_modes():
                out.copy_(x + SHIFT)
        return run


@pytest.fixture
def cpu_replay(monkeypatch):
    monkeypatch.setattr(replay, "_recording_allowed", lambda meta: True)
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)
    monkeypatch.delenv("M3_EAGLE_REPLAY", raising=False)


def _wrapper(replayer, runs):
    """Like `sparse_verify_step`'s `early`: `False` means one thing, any other value (0 included)
    another."""
    kernel = AddKernel()

    def call(x, meta, early):
        def run():
            runs.append(early)
            out = torch.empty_like(x)
            launch(kernel, (1,), x, out, SHIFT=100 if early is False else 1)
            return out
        return replayer.call(call_signature((x,), meta, (early,)), (x,), meta, run)
    return call


def test_false_and_zero_are_different_signatures(cpu_replay):
    replayer, runs = Replayer(), []
    call = _wrapper(replayer, runs)
    meta = Meta(torch.tensor([1]))
    x = torch.arange(4.0)
    torch.testing.assert_close(call(x, meta, False), x + 100, rtol=0, atol=0)  # recorded
    torch.testing.assert_close(call(x, meta, False), x + 100, rtol=0, atol=0)  # replayed
    torch.testing.assert_close(call(x, meta, 0), x + 1, rtol=0, atol=0)        # not False's recording
    assert runs == [False, 0]


def test_scalar_types_enter_the_signature():
    meta = Meta(torch.tensor([1]))
    x = torch.zeros(2)
    sig = lambda *scalars: call_signature((x,), meta, scalars)  # noqa: E731
    assert sig(False) != sig(0) and sig(True) != sig(1) and sig(4) != sig(4.0)
    assert sig(4, 0.5, None) == sig(4, 0.5, None)
