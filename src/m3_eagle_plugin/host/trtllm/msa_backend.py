"""MSA attention metadata and backend for MiniMax-M3 one-model Eagle3 verify steps.

Imported only once TensorRT-LLM is present (the route patch returns the backend for M3 on MSA).
Before NVIDIA/TensorRT-LLM#18872 the host's MSA metadata assumes one query token per generation
row. This subclass keeps the host's fields and plans and adds a `MsaDecodeMetadata` (the core's
multi-token step metadata) that is staged on `prepare()` and re-derived on the device in
`on_update_kv_lens()`: per-token cache slots, valid-block counts, `position + 1` kv lengths (one
plan row per query token) and proxy scratch sized by decode tokens. The per-token results are
published into the host's `msa_out_cache_loc` / `msa_n_valid_blocks` buffers, which the MSA
kernels read. All arithmetic is `m3_eagle_plugin.msa`'s.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from m3_eagle_plugin.host.trtllm.contract import resolve
from m3_eagle_plugin.msa import MsaDecodeMetadata, MsaInputError

HostMsaMetadata = resolve("msa_metadata_prepare")
HostMsaAttention = resolve("msa_attention")


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


class M3EagleMsaMetadata(HostMsaMetadata):
    """Host MSA metadata + per-token verify-row fields (see module docstring)."""

    def __post_init__(self) -> None:
        # Built first: the host's __post_init__ sizes its scratch through _msa_max_decode_tokens().
        self.m3_eagle_step: Optional[MsaDecodeMetadata] = None
        if getattr(self, "kv_cache_manager", None) is not None:
            self.m3_eagle_step = self._build_step_metadata()
        super().__post_init__()

    # ----- sizing --------------------------------------------------------------------------
    def _max_draft_len(self) -> int:
        manager = getattr(self, "kv_cache_manager", None)
        for owner, name in ((self, "max_draft_len"), (manager, "max_draft_len"),
                            (getattr(manager, "spec_config", None), "max_draft_len")):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
        return 0

    def _build_step_metadata(self) -> MsaDecodeMetadata:
        manager = self.kv_cache_manager
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        params = getattr(self, "sparse_metadata_params", None)
        # A CUDA-graph copy (create_cuda_graph_metadata) serves exactly its batch size, max_num_requests,
        # but keeps the eager max_num_sequences: sized by that, every graph staged the eager block table.
        rows = self.max_num_requests if getattr(self, "is_cuda_graph", False) else \
            _int(getattr(self, "max_num_sequences", None), self.max_num_requests)
        return MsaDecodeMetadata(
            max_num_requests=rows,
            max_num_tokens=self.max_num_tokens,
            max_blocks_per_seq=int(manager.max_blocks_per_seq),
            block_size=int(manager.tokens_per_block),
            device=device,
            max_draft_len=self._max_draft_len(),
            num_index_heads=_int(getattr(params, "num_index_heads", None), 1),
            proxy_scratch=False,  # the host's kernels score into the host's own scratch
        )

    def _msa_max_decode_tokens(self) -> int:
        """Host scratch sizing hook (`contract`'s msa_decode_scratch_sizing, so always present): one
        entry per decode *token* (1 + draft_len per row), no more than max_num_tokens (no step carries
        more; the host's own hook caps there too)."""
        base = super()._msa_max_decode_tokens()
        step = getattr(self, "m3_eagle_step", None)
        if step is None:
            return int(base)
        return max(int(base), min(step.scratch_decode_tokens, _int(self.max_num_tokens, step.scratch_decode_tokens)))

    # ----- per step ------------------------------------------------------------------------
    def _host_kv_lens(self, num_seqs: int) -> torch.Tensor:
        """Host kv lengths of the step; the host's `kv_lens` add the speculative extra slots."""
        extra = int(getattr(getattr(self, "kv_cache_params", None), "num_extra_kv_tokens", 0) or 0)
        return self.kv_lens[:num_seqs].to(torch.int64) - extra

    def _block_tables(self, request_ids: list[int]) -> torch.Tensor:
        """Raw slot ids per request. (V2's `get_batch_cache_indices` returns ids already multiplied
        by the mega-slot's page-index scale, which are not slots.)"""
        return self.kv_cache_manager.get_block_ids_per_seq(request_ids)

    def prepare(self) -> None:
        super().prepare()
        if self.m3_eagle_step is None:
            self.m3_eagle_step = self._build_step_metadata()
        num_seqs = int(self.num_seqs)
        num_contexts = int(self.num_contexts)
        qo_lens = self.seq_lens[:num_seqs].tolist()  # host (pinned) tensor: no device sync
        self._check_draft_lengths(qo_lens, num_contexts)
        request_ids = list(self.request_ids or [])[:num_seqs]
        self.m3_eagle_step.prepare(
            qo_lens, self._host_kv_lens(num_seqs), self._block_tables(request_ids),
            num_context_requests=num_contexts)
        self._publish()

    def _check_draft_lengths(self, qo_lens: list[int], num_contexts: int) -> None:
        """A generation row carries 1 + draft_len tokens in a linear chain, draft_len <= max_draft_len.

        A longer row (a tree's 1 + max_total_draft_tokens, or a draft length past the configured
        max) would be laid out as a chain (position = kv_len - qo_len + t), which is wrong for tree
        tokens, and overruns the per-token scratch sized by 1 + max_draft_len per row."""
        max_draft_len = self.m3_eagle_step.max_draft_len
        for row in range(max(num_contexts, 0), len(qo_lens)):
            if qo_lens[row] > 1 + max_draft_len:
                raise MsaInputError(
                    f"seq_lens[{row}] is {qo_lens[row]}: generation row {row} carries "
                    f"{qo_lens[row] - 1} draft tokens but max_draft_len is {max_draft_len} "
                    "(spec_config.max_draft_len; tree drafts are not supported)")

    def on_update_kv_lens(self) -> None:
        super().on_update_kv_lens()
        step = self.m3_eagle_step
        if step is None or step.num_requests == 0:
            return
        # kv_lens_cuda never counts the speculative extra slots (the host kv_lens do).
        step.on_update_kv_lens(self.kv_lens_cuda[: step.num_requests])
        self._publish()

    def _publish(self) -> None:
        """Copy the per-token fields into the host buffers the MSA kernels read (device only).

        `msa_out_cache_loc` (`[max_num_tokens]`) takes every token's slot and -1 past them, so a
        shorter step leaves nothing of a longer one behind. `msa_n_valid_blocks` is the host's
        decode scratch, sized by decode tokens (`_msa_max_decode_tokens`): it is read by the decode
        kernels only, and only a decode-only step is published there (prefill and mixed steps run
        the host's eager plans with their own per-token counts). A count there is at least 1, as the
        pre-#18872 host's on_update_kv_lens has it (57ea1cdf): a token before its row's first key (a
        CUDA-graph padding row) sees no block of the step, but 0 masks every block in that host's GQA
        and NaNs the row (12b1dd65's kernels take 0; a padding row's output is discarded either way)."""
        step = self.m3_eagle_step
        slots = getattr(self, "msa_out_cache_loc", None)
        if slots is not None:
            slots = slots.view(-1)
            source = step.cache_slots_buffer
            if slots.numel() < step.num_tokens:
                raise RuntimeError(f"msa_out_cache_loc holds {slots.numel()} entries but the step has "
                                   f"{step.num_tokens} tokens")
            n = min(slots.numel(), source.numel())
            slots[:n].copy_(source[:n])
            slots[n:].fill_(-1)
            self._publish_padding_slots(slots[: step.num_tokens])
        valid = getattr(self, "msa_n_valid_blocks", None)
        if valid is not None and step.is_decode_only:
            values = step.valid_blocks
            if valid.numel() < values.numel():
                raise RuntimeError(
                    f"msa_n_valid_blocks holds {valid.numel()} entries but the step has {values.numel()} "
                    "query tokens: the host sized it by batch, not by verify tokens")
            valid.view(-1)[: values.numel()].copy_(values.clamp(min=1))

    def _publish_padding_slots(self, slots: torch.Tensor) -> None:
        """A token before its row's first key (a CUDA-graph padding row whose kv length was corrected
        below its query length) writes its row's own first slot, as the host's on_update_kv_lens
        has it. The step keeps -1 there, but the host's cache writers (write_kv_slots) do not skip
        -1: they index page -1, the pool's last page, which another request may hold."""
        step = self.m3_eagle_step
        if step.num_tokens == 0:
            return
        first_page = step.block_tables[:, 0].index_select(0, step.token_request)
        own_first = (first_page.to(torch.int64) * step.block_size).to(slots.dtype)
        before_keys = (step.positions < 0) & (first_page >= 0)
        # on the step's device: the host keeps its buffer there, a test double may not
        slots.copy_(torch.where(before_keys, own_first, slots.to(before_keys.device)))

    # ----- per-token plan rows (one row per query token: kv segment = position + 1) ------------
    def m3_eagle_plan_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(request row, kv segment length) per query token, for per-token plan construction."""
        step = self.m3_eagle_step
        return step.token_request, step.token_kv_lens


class M3EagleMsaSparseAttention(HostMsaAttention):
    """The host's MSA backend with the multi-token verify metadata."""

    Metadata = M3EagleMsaMetadata
