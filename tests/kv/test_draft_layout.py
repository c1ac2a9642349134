"""Shared draft layout: the upstream case table and the spec-config layer count."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from m3_eagle_plugin.kv import derive_shared_draft_layout, shared_draft_layer_count


@pytest.mark.parametrize(
    "num_layers, heads, num_draft, expected",
    [
        (60, 4, 1, ([60], 60)),  # scalar heads: the draft tail is appended to the target count
        (60, [4] * 60 + [64], 1, ([60], 60)),  # a head list is the total (target + draft)
        (60, [4] * 61, 1, ([60], 60)),  # equal head counts in the list
        (61, [4] * 60 + [64], 1, ([60], 60)),  # num_layers already includes the draft layer
        (60, [4] * 60, 0, ([], 60)),  # no draft
        (60, 4, 0, ([], 60)),
        (None, 4, 1, ([], None)),  # nothing pins the range
        (None, [4] * 5, 2, ([3, 4], 3)),
        (60, 4, 2, ([60, 61], 60)),
    ],
)
def test_upstream_case_table(num_layers, heads, num_draft, expected):
    assert derive_shared_draft_layout(num_layers, heads, num_draft) == expected


def test_bad_draft_counts_are_rejected():
    with pytest.raises(ValueError, match="num_draft_layers"):
        derive_shared_draft_layout(60, 4, -1)
    with pytest.raises(TypeError, match="num_draft_layers"):
        derive_shared_draft_layout(60, 4, 1.5)
    with pytest.raises(ValueError, match="do not fit"):
        derive_shared_draft_layout(None, [4], 2)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(target=st.integers(0, 80), drafts=st.integers(0, 3), as_list=st.booleans(),
       pre_extended=st.booleans())
def test_draft_tail_sits_right_above_the_target(target, drafts, as_list, pre_extended):
    heads = [4] * target + [8] * drafts if as_list else 4
    num_layers = target + drafts if (pre_extended and as_list) else target
    ids, num_target = derive_shared_draft_layout(num_layers, heads, drafts)
    assert num_target == target
    assert ids == [target + i for i in range(drafts)]


def _eagle3(num_draft_hidden_layers=None):
    mode = SimpleNamespace(is_mtp_eagle_one_model=lambda: False, is_mtp_vanilla=lambda: False,
                           is_eagle3_one_model=lambda: True)
    return SimpleNamespace(spec_dec_mode=mode, _num_draft_hidden_layers=num_draft_hidden_layers)


def test_shared_draft_layer_count_follows_the_base_manager():
    assert shared_draft_layer_count(_eagle3(), None) == 1
    assert shared_draft_layer_count(_eagle3(2), None) == 2
    assert shared_draft_layer_count(_eagle3(), [True] * 60) == 0
    assert shared_draft_layer_count(None, None) == 0


def test_shared_draft_layer_count_other_modes():
    mtp = SimpleNamespace(
        spec_dec_mode=SimpleNamespace(is_mtp_eagle_one_model=lambda: False,
                                      is_mtp_vanilla=lambda: True),
        num_nextn_predict_layers=3)
    assert shared_draft_layer_count(mtp, None) == 3
    shared = _eagle3()
    shared._use_shared_kv_cache = True
    assert shared_draft_layer_count(shared, None) == 0
    two_model = SimpleNamespace(spec_dec_mode=SimpleNamespace(is_eagle3_one_model=lambda: False))
    assert shared_draft_layer_count(two_model, None) == 0
    with pytest.raises(TypeError, match="spec_dec_mode"):
        shared_draft_layer_count(object(), None)


@pytest.mark.parametrize("value", [1.5, 2.7, True, "2"])
def test_a_non_integer_draft_layer_count_in_the_spec_config_is_refused_not_truncated(value):
    """1.5 MTP layers or 2.7 Eagle3 hidden layers read as 1 and 2 appended draft layers."""
    mtp = SimpleNamespace(
        spec_dec_mode=SimpleNamespace(is_mtp_eagle_one_model=lambda: False,
                                      is_mtp_vanilla=lambda: True),
        num_nextn_predict_layers=value)
    with pytest.raises(TypeError, match="num_nextn_predict_layers must be an int"):
        shared_draft_layer_count(mtp, None)
    with pytest.raises(TypeError, match="_num_draft_hidden_layers must be an int"):
        shared_draft_layer_count(_eagle3(value), None)


def test_a_negative_draft_layer_count_in_the_spec_config_is_refused_naming_it():
    with pytest.raises(ValueError, match="_num_draft_hidden_layers must be an int >= 0, got -1"):
        shared_draft_layer_count(_eagle3(-1), None)


def test_a_num_layers_above_the_head_list_length_wins():
    """Docstring rule: a per-layer head list pins the total unless ``num_layers`` is larger (then it
    was already extended and wins). 61 layers, a 60-entry list, one draft: the draft is layer 60."""
    assert derive_shared_draft_layout(61, [4] * 60, 1) == ([60], 60)
    assert derive_shared_draft_layout(10, [4] * 3, 2) == ([8, 9], 8)


def test_mtp_eagle_one_model_appends_one_draft_layer():
    """MTP-Eagle one-model runs its single MTP layer for every draft step: one cache layer, whatever
    num_nextn_predict_layers says."""
    mode = SimpleNamespace(is_mtp_eagle_one_model=lambda: True, is_mtp_vanilla=lambda: False)
    spec = SimpleNamespace(spec_dec_mode=mode, num_nextn_predict_layers=3)
    assert shared_draft_layer_count(spec, None) == 1
    assert shared_draft_layer_count(spec, [True] * 4) == 0


@pytest.mark.parametrize("heads", [4, [4, 4]])
def test_a_negative_num_layers_is_refused_naming_it(heads):
    """With a head list, -1 used to lose to the list length and pass unnoticed."""
    with pytest.raises(ValueError, match="num_layers must be >= 0"):
        derive_shared_draft_layout(-1, heads, 1)


@pytest.mark.parametrize("heads, shown", [(2.5, "float 2.5"), ("8", "str '8'"), (None, "NoneType None"),
                                          ("array", "ndarray array"), ("tensor", "Tensor tensor")])
def test_heads_of_neither_accepted_form_are_refused_naming_both_forms(heads, shown):
    """A per-layer numpy array or tensor (not a list) was refused as "num_kv_heads must be an int",
    as if a list of per-layer ints were not taken either."""
    import numpy as np
    import torch

    if heads in ("array", "tensor"):
        heads = np.array([8, 8, 8]) if heads == "array" else torch.tensor([8, 8, 8])
    with pytest.raises(TypeError, match=rf"^num_kv_heads must be an int or a list of per-layer ints, got {shown}"):
        derive_shared_draft_layout(3, heads, 1)
    assert derive_shared_draft_layout(3, [8, 8, 8], 1) == ([2], 2)  # the list form is taken
    assert derive_shared_draft_layout(3, np.int64(8), 1) == ([3], 3)  # any integer is a scalar count
