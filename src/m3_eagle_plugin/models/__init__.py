"""MiniMax-M3 target on the paged cache, its config parsing and checkpoint loading.

`load_target(path, dtype, device)` reads a production or transformers-written checkpoint;
`MiniMaxM3ForCausalLM.forward(input_ids, meta, cache, *, capture=None) -> hidden [T, H]` and
`compute_logits(hidden) -> fp32 [T, V]`. `m3-eagle make-tiny` lives in `models.tiny`.
"""
from m3_eagle_plugin.models.config import ConfigError, M3Config
from m3_eagle_plugin.models.loader import load_target
from m3_eagle_plugin.models.model import MiniMaxM3ForCausalLM
from m3_eagle_plugin.models.safetensors_source import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "M3Config", "MiniMaxM3ForCausalLM", "load_target"]
