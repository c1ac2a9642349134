"""The package's one strict-int rule (`_ints`): any integer is one, nothing else is turned into one."""
import operator

import numpy as np
import pytest
import torch

from m3_eagle_plugin._ints import as_int, exact_index
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.parallel.sharding import shard_heads, shard_width

INTEGERS = [(3, 3), (np.int64(3), 3), (np.int32(-2), -2), (np.uint8(7), 7), (torch.tensor(5), 5)]
NOT_INTEGERS = [True, False, np.bool_(True), 2.0, 2.5, np.float32(2.0), "2", b"2", None, [2], torch.tensor(2.0)]


@pytest.mark.parametrize("value, want", INTEGERS)
def test_integers_of_every_kind_come_back_as_python_ints(value, want):
    for got in (exact_index(value), as_int("x", value)):
        assert got == want and type(got) is int


@pytest.mark.parametrize("value", NOT_INTEGERS, ids=repr)
def test_bools_floats_strings_and_none_are_never_turned_into_ints(value):
    assert exact_index(value) is None
    with pytest.raises(TypeError, match=r"^width must be an int, got "):
        as_int("width", value)


def test_the_minimum_and_the_error_class_are_the_callers():
    assert as_int("n", 0, 0) == 0
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        as_int("n", np.int64(0), 1)

    class Refused(Exception):
        pass

    with pytest.raises(Refused, match=r"n must be an int >= 1, got bool"):
        as_int("n", True, 1, Refused)  # a wrong type raises the caller's class too
    with pytest.raises(Refused, match=r"n must be an int >= 1, got -3"):
        as_int("n", -3, 1, Refused)


def test_engine_settings_from_an_array_are_stored_as_ints():
    """Before one rule, the engine refused a numpy draft_len that the KV layer and the request
    path already took; now every setting is taken and stored as a plain int."""
    config = EngineConfig(draft_len=np.int64(2), max_batch_size=np.int32(4), max_seq_len=np.int64(64),
                          eos_ids=(np.int64(7),))
    assert (config.draft_len, config.max_batch_size, config.max_seq_len, config.eos_ids) == (2, 4, 64, (7,))
    assert all(type(v) is int for v in (config.draft_len, config.max_batch_size, config.max_seq_len, *config.eos_ids))
    with pytest.raises(ValueError, match="draft_len must be an int >= 0, got float 2.0"):
        EngineConfig(draft_len=2.0)


def test_sharding_takes_numpy_head_counts_and_answers_plain_ints():
    shape = shard_heads(np.int64(64), np.int64(4), np.int64(4), np.int64(4))
    assert (shape.tp_size, shape.q_heads, shape.kv_heads, shape.index_heads) == (4, 16, 1, 1)
    assert all(type(v) is int for v in (shape.tp_size, shape.q_heads, shape.kv_heads, shape.index_heads))
    assert type(shard_width("width", np.int64(96), 4)) is int
    with pytest.raises(TypeError, match="num_heads must be an int, got float 64.0"):
        shard_heads(64.0, 4, 4, 4)


@pytest.mark.parametrize("value", [torch.tensor(True), torch.tensor([5]), torch.tensor([[5]]), torch.tensor([True])])
def test_a_torch_bool_or_a_one_element_tensor_is_not_an_int(value):
    """torch gives these __index__ (True read as 1, [5] as 5); numpy's own rule refuses the 1-d array."""
    with pytest.raises(TypeError):
        operator.index(np.array([5]))
    assert exact_index(value) is None
    with pytest.raises(TypeError, match="^draft_len must be an int, got Tensor"):
        as_int("draft_len", value)
