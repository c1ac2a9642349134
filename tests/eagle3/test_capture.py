"""AuxCapture: layer-id convention, storage modes, and equality with transformers' hidden states."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.eagle3.capture import AuxCapture


@settings(max_examples=20, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True), tokens=st.integers(1, 5),
       hidden=st.sampled_from([4, 8]), preallocate=st.booleans())
def test_stacked_is_the_concat_in_layer_id_order(ids, tokens, hidden, preallocate):
    capture = AuxCapture(ids)
    if preallocate:
        capture.allocate(8, hidden, torch.float32, "cpu")
    recorded = {}
    for layer in range(13):  # a forward visits layers in order; ids may be given in any order
        x = torch.full((tokens, hidden), float(layer)) + torch.arange(tokens)[:, None]
        if capture.wants(layer):
            recorded[layer] = x
        capture.record(layer, x)
    want = torch.cat([recorded[i] for i in ids], dim=-1)
    assert torch.equal(capture.stacked(), want)
    for i in ids:
        assert torch.equal(capture.get(i), recorded[i])


def test_output_layer_ids_are_shifted_by_one():
    assert AuxCapture.from_output_layer_ids([1, 29, 56]).layer_ids == (2, 30, 57)


def test_preallocated_buffer_is_reused():
    capture = AuxCapture([0, 2]).allocate(4, 3, torch.float32, "cpu")
    capture.record(0, torch.ones(2, 3))
    capture.record(2, torch.ones(2, 3) * 2)
    first = capture.stacked()
    capture.reset()
    capture.record(0, torch.ones(3, 3) * 5)
    capture.record(2, torch.ones(3, 3) * 6)
    second = capture.stacked()
    assert second.shape == (3, 6) and first.data_ptr() == second.data_ptr()
    assert torch.equal(second[:, 3:], torch.full((3, 3), 6.0))


def test_errors():
    with pytest.raises(ValueError):
        AuxCapture([])
    with pytest.raises(ValueError):
        AuxCapture([1, 1])
    capture = AuxCapture([1, 2])
    capture.record(1, torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match=r"\[2\]"):
        capture.stacked()
    with pytest.raises(KeyError):
        capture.get(3)
    small = AuxCapture([0]).allocate(1, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="too small"):
        small.record(0, torch.zeros(2, 2))


def test_captures_equal_transformers_hidden_states(tmp_path):
    """Input of layer i == transformers' output_hidden_states[i], for every token of a verify step."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.models.loader import load_target
    from m3_eagle_plugin.models.tiny import make_tiny
    from m3_eagle_plugin.msa.metadata import MsaDecodeMetadata

    target_dir, _ = make_tiny(tmp_path, seed=2)
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids[None], output_hidden_states=True).hidden_states
    model = load_target(target_dir)
    cfg = model.config
    cache = PagedKVCache.for_minimax_m3(cfg.num_layers, cfg.sparse_layer_ids, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.index_dim, cfg.block_size, 16, dtype=torch.float32)
    meta = MsaDecodeMetadata(1, 32, 16, cfg.block_size, "cpu", max_draft_len=4, num_index_heads=cfg.index_heads)
    cache.add_request("r")
    capture = AuxCapture([0, 3, 5, 7])
    for start, n in ((0, 16), (16, 4)):  # prefill, then a 1+3 verify chunk
        cache.reserve("r", start + n)
        meta.prepare([n], [start + n], cache.block_table(["r"]))
        with torch.no_grad():
            model(ids[start:start + n], meta, cache, capture=capture)
        for i in capture.layer_ids:
            torch.testing.assert_close(capture.get(i), want[i][0, start:start + n], atol=1e-4, rtol=0)


def test_preallocated_buffer_refuses_a_layer_missing_from_this_step():
    """The buffer still holds the previous step's rows: a layer not recorded since `reset` must not
    be served from them (the default mode raises for the same step)."""
    capture = AuxCapture([0, 2]).allocate(4, 3, torch.float32, "cpu")
    capture.record(0, torch.ones(2, 3))
    capture.record(2, torch.ones(2, 3) * 2)
    capture.reset()
    capture.record(0, torch.ones(2, 3) * 5)  # layer 2 never ran in this step
    with pytest.raises(RuntimeError, match=r"\[2\]"):
        capture.stacked()
    with pytest.raises(RuntimeError, match="layer 2"):
        capture.get(2)


def test_preallocated_buffer_refuses_layers_of_different_lengths():
    capture = AuxCapture([0, 2]).allocate(4, 3, torch.float32, "cpu")
    capture.record(0, torch.ones(3, 3))
    with pytest.raises(ValueError, match="layer 2 recorded 2 tokens"):
        capture.record(2, torch.ones(2, 3))


def test_preallocated_buffer_refuses_a_state_of_another_width():
    """A [T, 4] state in a buffer allocated for hidden size 8 would leave zero columns in `stacked()`
    and misplace the later chunks."""
    capture = AuxCapture([0, 1]).allocate(4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="layer 0 state is 4 wide.*hidden size 8"):
        capture.record(0, torch.ones(2, 4))


def test_default_mode_refuses_layers_of_different_lengths():
    capture = AuxCapture([0, 2])
    capture.record(0, torch.ones(3, 3))
    with pytest.raises(ValueError, match="layer 2 recorded 2 tokens, earlier layers of this step 3"):
        capture.record(2, torch.ones(2, 3))


@pytest.mark.parametrize("preallocate", [False, True])
@pytest.mark.parametrize("shape", [(3,), (1, 3, 4), ()])
def test_a_state_that_is_not_two_dimensional_is_refused_by_name(preallocate, shape):
    """Without a buffer a [T] state was kept and `stacked()` came out 1-D; with one, the unpacking
    of its shape failed with Python's own 'not enough values to unpack'."""
    capture = AuxCapture([0])
    if preallocate:
        capture.allocate(4, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=rf"^hidden of layer 0 must be \[T, H\] .*got shape {re.escape(str(shape))}$"):
        capture.record(0, torch.ones(shape))
    with pytest.raises(TypeError, match=r"^hidden of layer 0 must be a \[T, H\] tensor, got list$"):
        capture.record(0, [[1.0] * 4])


def test_a_step_that_fills_the_preallocated_buffer_exactly_is_recorded():
    """max_tokens is the largest step the buffer holds (the check is t > max_tokens, not >=)."""
    capture = AuxCapture([1, 3]).allocate(3, 2, torch.float32, "cpu")
    a, b = torch.arange(6.0).view(3, 2), -torch.arange(6.0).view(3, 2)
    capture.record(1, a)
    capture.record(3, b)
    assert torch.equal(capture.stacked(), torch.cat([a, b], dim=-1))


@pytest.mark.parametrize("ids", [[-1, 2], [3, -2]])
def test_a_negative_layer_id_is_refused(ids):
    """Layer ids index the target's layers from 0; a negative one never matches a layer the forward visits."""
    with pytest.raises(ValueError, match=r"^aux layer ids must be distinct and non-negative, got "):
        AuxCapture(ids)


# ---- review: inputs the tests above did not model ----


@pytest.mark.parametrize("bad", [2.7, "2", True])
def test_a_layer_id_that_is_not_an_integer_is_refused_not_truncated(bad):
    """The package's int rule (`_ints`): layer 2.7, "2" or True is refused by name, never read as
    layer 2 or 1 (int() did), so a capture never silently records a layer nobody asked for."""
    with pytest.raises(TypeError, match=r"^aux layer id must be an int"):
        AuxCapture([bad, 4])
    with pytest.raises(TypeError, match=r"^output layer id must be an int"):
        AuxCapture.from_output_layer_ids([bad, 4])


@pytest.mark.parametrize("ids", [[1, 29, 56, -1], [-1, 1], [-2, 1]])
def test_trtllm_final_hidden_id_is_refused_not_read_as_the_embeddings(ids):
    """TensorRT-LLM's Eagle3SpecMetadata reads output id -1 as the model's final hidden state (it moves
    -1 to the end of `layers_to_capture`); j + 1 = 0 made it the input of layer 0, the embeddings."""
    with pytest.raises(ValueError, match=r"output layer ids must be non-negative, got .*-\d.*final hidden state"):
        AuxCapture.from_output_layer_ids(ids)


def test_a_new_buffer_holds_no_step_until_one_is_recorded():
    """After `allocate` (a larger buffer between steps) the last step's layers no longer read as
    recorded: `stacked()` and `get()` refuse, as the default mode does, instead of serving the new
    buffer's zeros as that step's states."""
    capture = AuxCapture([0, 2]).allocate(4, 3, torch.float32, "cpu")
    capture.record(0, torch.ones(2, 3))
    capture.record(2, torch.full((2, 3), 2.0))
    capture.allocate(8, 3, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"\[0, 2\] were not recorded"):
        capture.stacked()
    with pytest.raises(RuntimeError, match="layer 0 was not recorded"):
        capture.get(0)
    capture.record(0, torch.full((5, 3), 3.0))
    capture.record(2, torch.full((5, 3), 4.0))
    assert torch.equal(capture.stacked(), torch.cat([torch.full((5, 3), 3.0), torch.full((5, 3), 4.0)], dim=-1))


@pytest.mark.parametrize("max_tokens, hidden_size, error, message", [
    (-1, 64, ValueError, r"^max_tokens must be an int >= 0, got -1$"),  # torch: "Dimension size must be non-negative"
    (8, -2, ValueError, r"^hidden_size must be an int >= 1, got -2$"),
    (2.5, 64, TypeError, r"^max_tokens must be an int >= 0, got float 2\.5$"),
    (8, True, TypeError, r"^hidden_size must be an int >= 1, got bool$"),  # was a buffer one column a layer
])
def test_allocate_names_the_size_it_cannot_use_and_keeps_its_buffer(max_tokens, hidden_size, error, message):
    cap = AuxCapture([1, 2]).allocate(4, 3, torch.float32, "cpu")
    cap.record(1, torch.ones(2, 3))
    with pytest.raises(error, match=message):
        cap.allocate(max_tokens, hidden_size, torch.float32, "cpu")
    assert cap.get(1).shape == (2, 3)  # the earlier buffer and its step are left as they were


@pytest.mark.parametrize("dtype, device, state", [
    (torch.bfloat16, "cpu", torch.full((2, 3), 1.0 + 2.0 ** -12)),  # was rounded to bf16's 1.0 silently
    (torch.float32, "cpu", torch.ones(2, 3, dtype=torch.float16)),  # was widened: stacked() no longer fp16
    (torch.float32, "meta", torch.ones(2, 3)),  # was "copied" to meta: stacked() held no values at all
])
def test_preallocated_buffer_refuses_a_state_of_another_dtype_or_device(dtype, device, state):
    """The default mode keeps each state as the layer made it; the buffer's `copy_` cast it to the
    buffer's dtype (or moved it to the buffer's device), so the two modes' `stacked()` differed."""
    default = AuxCapture([0])
    default.record(0, state)
    assert default.stacked().dtype == state.dtype and torch.equal(default.stacked(), state)
    capture = AuxCapture([0]).allocate(4, 3, dtype, device)
    with pytest.raises(ValueError, match=rf"^layer 0 state is {state.dtype} on cpu, the capture buffer was "
                                         rf"allocated as {dtype} on {device}"):
        capture.record(0, state)
    with pytest.raises(RuntimeError, match="not recorded"):
        capture.stacked()


@pytest.mark.parametrize("preallocate, state, message", [
    (True, torch.ones(5, 3), r"^capture buffer \(4, 6\) too small for \[5, 3\] for the step$"),
    (True, torch.ones(2, 4), r"^the step's state is 4 wide, the capture buffer was allocated for hidden size 3$"),
    (True, torch.ones(2, 3, dtype=torch.float64), r"^the step's state is torch.float64 on cpu, the capture buffer"),
    (True, torch.ones(1, 2, 3), r"^hidden of the step must be \[T, H\]"),
    (False, torch.ones(2), r"^hidden of the step must be \[T, H\]"),
])
def test_check_step_refuses_before_any_layer_what_record_would_refuse(preallocate, state, message):
    """`record` refuses such a step only at the first aux layer, after the target's earlier layers
    wrote the step's KV (ids (2, L//2, L-3): layers 0 and 1); `check_step` on the step's embeddings
    refuses it before any layer runs, and leaves the capture (and the last step's states) as they were."""
    capture = AuxCapture([0, 2])
    if preallocate:
        capture.allocate(4, 3, torch.float32, "cpu")
    last = [torch.full((3, 3), 1.0), torch.full((3, 3), 2.0)]
    capture.record(0, last[0])
    capture.record(2, last[1])
    with pytest.raises(ValueError, match=message):
        capture.check_step(state)
    assert torch.equal(capture.stacked(), torch.cat(last, dim=-1))


def test_check_step_passes_a_step_the_buffer_takes_and_records_nothing():
    capture = AuxCapture([0, 2]).allocate(4, 3, torch.float32, "cpu")
    capture.check_step(torch.ones(4, 3))
    capture.check_step(torch.ones(0, 3))
    with pytest.raises(RuntimeError, match=r"\[0, 2\] were not recorded"):
        capture.stacked()
    AuxCapture([1]).check_step(torch.ones(7, 5))  # without a buffer any [T, H] step fits
