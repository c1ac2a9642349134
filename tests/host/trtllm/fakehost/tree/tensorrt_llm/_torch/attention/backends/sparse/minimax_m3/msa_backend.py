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
        n = self.num_seqs
        self._publish_rows(self.kv_lens[:n] - self.kv_cache_params.num_extra_kv_tokens)

    def on_update_kv_lens(self) -> None:
        # as the host's (57ea1cdf): re-derive its own length-dependent state from the corrected
        # device lengths, which never count the speculative extra slots
        self._publish_rows(self.kv_lens_cuda[: self.num_seqs].cpu())

    def _publish_rows(self, kv_lens) -> None:
        """One token per row, the last position. `msa_plan_kv_lens` stands for the host's decode
        plans (their kv segment lengths): state only the host's own methods keep up to date."""
        page = self.kv_cache_manager.tokens_per_block
        rows = self.kv_cache_manager.get_block_ids_per_seq(self.request_ids[: self.num_seqs]).tolist()
        self.msa_plan_kv_lens = kv_lens.to(torch.int32).clone()
        for i in range(self.num_seqs):
            pos = int(kv_lens[i]) - 1
            index = min(max(pos, 0), len(rows[i]) * page - 1)  # the host clamps into the row's table
            self.msa_out_cache_loc[i] = rows[i][index // page] * page + index % page
            self.msa_n_valid_blocks[i] = -(-max(pos + 1, 1) // page)  # clamp_min(1), as the host


class MiniMaxM3MsaSparseAttention(TrtllmAttention):
    Metadata = MiniMaxM3MsaSparseAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads=None,
                 quant_config=None, *, sparse_params=None, **kwargs):
        super().__init__(layer_idx, num_heads, head_dim, num_kv_heads, quant_config, **kwargs)
        self.sparse_params = sparse_params
