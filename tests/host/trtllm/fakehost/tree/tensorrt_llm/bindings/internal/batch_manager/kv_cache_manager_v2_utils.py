"""Double of the native block-offset copy (compiled in the real host)."""
import torch

CALLS = []


def copy_batch_block_offsets_to_device(src, dst, copy_idx, index_scales, kv_offset, stream):
    """dst[p, i, 0] = src[p, copy_idx[i], 0] * index_scales[p]; dst[p, i, 1] = that + kv_offset[p];
    negative (unused) slot ids stay -1."""
    CALLS.append((src.shape[0], dst.shape[0], stream))
    for p in range(src.shape[0]):
        for i, row in enumerate(copy_idx.tolist()):
            slots = src[p, row, 0].to(torch.int64)
            k = torch.where(slots >= 0, slots * int(index_scales[p]), torch.full_like(slots, -1))
            v = torch.where(slots >= 0, k + int(kv_offset[p]), k)
            dst[p, i, 0, : k.numel()] = k.to(dst.dtype)
            dst[p, i, 1, : v.numel()] = v.to(dst.dtype)
