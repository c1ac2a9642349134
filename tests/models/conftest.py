"""Session fixtures: tiny checkpoints written by transformers and by `m3-eagle make-tiny`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._oracle import MiniMaxM3VLForCausalLM, randomize_, tiny_text_config


@pytest.fixture(scope="session")
def hf_text_checkpoint(tmp_path_factory) -> Path:
    """MiniMaxM3VLForCausalLM.save_pretrained output (text layout, fused MoE tensors)."""
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(tiny_text_config())
    randomize_(model, seed=1)
    out = tmp_path_factory.mktemp("hf_text")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """`m3-eagle make-tiny` output (production-layout target + Eagle3 draft)."""
    from m3_eagle_plugin.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    make_tiny(out, seed=5)
    return out
