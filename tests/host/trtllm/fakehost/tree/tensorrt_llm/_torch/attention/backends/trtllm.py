from dataclasses import dataclass

import torch

from .interface import AttentionMetadata


@dataclass(kw_only=True)
class TrtllmAttentionMetadata(AttentionMetadata):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.kv_lens = torch.zeros(self.max_num_sequences, dtype=torch.int32)
        # as in the host: the device copy lives on the GPU where there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.kv_lens_cuda = torch.zeros(self.max_num_sequences, dtype=torch.int32, device=device)

    def prepare(self) -> None:
        n = self.num_seqs
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq[:n], dtype=torch.int32)
        kv = cached + self.seq_lens[:n].to(torch.int32)
        # as in the host: the host copy adds the speculative extra slots, the device copy does not
        self.kv_lens[:n] = kv + self.kv_cache_params.num_extra_kv_tokens
        self.kv_lens_cuda[:n].copy_(kv)


class TrtllmAttention:
    Metadata = TrtllmAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads=None,
                 quant_config=None, **kwargs):
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
