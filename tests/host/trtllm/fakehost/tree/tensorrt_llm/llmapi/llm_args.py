"""Double of the user-facing configs the adapter reads."""
from dataclasses import dataclass

from tensorrt_llm._torch.speculative.interface import SpeculativeDecodingMode


@dataclass
class MiniMaxM3SparseAttentionConfig:
    algorithm: str = "minimax_m3"
    implementation: str = "msa"
    sparse_num_index_heads: int = 4
    sparse_block_size: int = 128


@dataclass
class RocketSparseAttentionConfig:
    algorithm: str = "rocket"


class Eagle3DecodingConfig:
    def __init__(self, max_draft_len: int = 3, one_model: bool = True):
        self.max_draft_len = max_draft_len
        self.spec_dec_mode = (SpeculativeDecodingMode.EAGLE3_ONE_MODEL if one_model
                              else SpeculativeDecodingMode.EAGLE3)
        self._allow_separate_draft_kv_cache = True
        self._use_shared_kv_cache = False
        self._num_draft_hidden_layers = None
