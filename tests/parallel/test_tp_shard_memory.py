"""A rank's shard holds only its own slice of every cut weight, and is as inference-only as the
model it was cut from (`load_target` / `load_draft` return models whose parameters need no grad).

First principles, not the code under test: a cut weight of shape S needs prod(S) elements of
storage; the unsharded model must read the same after the shard's weights are overwritten.
"""
import io

import pytest
import torch

from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.parallel import rank_config
from m3_eagle_plugin.parallel.tp_model import shard_draft_head, shard_state_dict, shard_target

TP = 2


@pytest.fixture(scope="module")
def full_model(tiny_pair):
    return load_target(tiny_pair[0], dtype=torch.float32)


def _shard_state(model, rank):
    with torch.device("meta"):
        skeleton = MiniMaxM3ForCausalLM(rank_config(model.config, TP))
    shapes = {n: t.shape for n, t in skeleton.state_dict().items()}
    return shard_state_dict(model.state_dict(), shapes, rank, TP)


def test_cut_weights_hold_only_the_ranks_slice(full_model):
    """Row cuts (q/k/v, index_q) were views into the whole unsharded tensor: a rank kept the full
    projection alive (no memory saved by TP once the full model is dropped, the full tensor saved
    with the shard's state dict) and writing the shard wrote the unsharded model."""
    full_state = full_model.state_dict()
    before = {n: t.clone() for n, t in full_state.items()}
    for rank in range(TP):
        state = _shard_state(full_model, rank)
        cut = {n: t for n, t in state.items() if t.shape != full_state[n].shape}
        assert any(n.endswith("self_attn.q_proj.weight") for n in cut)
        assert any(n.endswith("self_attn.indexer.q_proj.weight") for n in cut)
        for name, tensor in cut.items():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
            buf = io.BytesIO()
            torch.save(tensor, buf)
            assert buf.tell() < tensor.numel() * tensor.element_size() + 4096, name  # not the full tensor
            tensor.fill_(123.0)
    for name, tensor in full_model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_shard_is_inference_only_like_its_source(full_model, tiny_pair):
    from m3_eagle_plugin.eagle3.checkpoint import load_draft

    assert not any(p.requires_grad for p in full_model.parameters())
    shard = shard_target(full_model, 0, 1)
    assert not any(p.requires_grad for p in shard.parameters())
    head = load_draft(tiny_pair[1], full_model, dtype=torch.float32)
    assert not any(p.requires_grad for p in head.parameters())
    head_shard = shard_draft_head(head, 0, 1)
    assert not any(p.requires_grad for p in head_shard.parameters())
