"""Double of the pre-#18872 MSA backend: one decode token per generation row, scratch sized by batch."""
from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention.backends.trtllm import TrtllmAttention, TrtllmAttentionMetadata


@dataclass(init=False)
class MiniMaxM3MsaSparseAttentionMetadata(TrtllmAttentionMetadata):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.msa_out_cache_loc = torch.full((self.max_num_tokens,), -1, dtype=torch.int32)
        self.msa_n_valid_blocks = torch.zeros(self._msa_max_decode_tokens(), dtype=torch.int32)

    def _msa_max_decode_tokens(self) -> int:
        return self.max_num_sequences

    def prepare(self) -> None:
        super().prepare()
        page = self.kv_cache_manager.tokens_per_block
        rows = self.kv_cache_manager.get_block_ids_per_seq(self.request_ids[: self.num_seqs]).tolist()
        for i in range(self.num_seqs):  # one token per row: the last position only
            pos = int(self.kv_lens[i]) - self.kv_cache_params.num_extra_kv_tokens - 1
            self.msa_out_cache_loc[i] = rows[i][pos // page] * page + pos % page
            self.msa_n_valid_blocks[i] = pos // page + 1

    def on_update_kv_lens(self) -> None:
        pass


class MiniMaxM3MsaSparseAttention(TrtllmAttention):
    Metadata = MiniMaxM3MsaSparseAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads=None,
                 quant_config=None, *, sparse_params=None, **kwargs):
        super().__init__(layer_idx, num_heads, head_dim, num_kv_heads, quant_config, **kwargs)
        self.sparse_params = sparse_params
