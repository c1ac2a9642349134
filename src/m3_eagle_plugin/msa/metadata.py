"""Per-step MSA metadata for mixed batches with multi-token (Eagle3 verify) rows.

One ``MsaDecodeMetadata`` lives for the whole engine: every buffer is allocated in ``__init__``
so the per-step views keep their addresses (CUDA graphs replay against them). ``prepare`` runs
on the host once per step: it validates the lengths, stages them in one host buffer and ships
them with a single (pinned, non-blocking) copy, then derives the per-token fields on the device.
``on_update_kv_lens`` re-derives those fields on the device only, after the overlap scheduler
has corrected the optimistic kv lengths staged by ``prepare`` (corrections only shrink them).

Token ``t`` of request ``r`` sits at ``position = kv_len[r] - qo_len[r] + t``. Derived per token:
``cache_slots = page * B + position % B`` with ``page = block_tables[r, position // B]`` (``-1``
for tokens past the step or at negative positions), ``token_kv_lens = position + 1`` and
``valid_blocks = ceil(token_kv_lens / B)`` (both clamped at 0).
"""

from __future__ import annotations

from typing import Sequence

import torch

from m3_eagle_plugin._ints import as_int

from .blocks import (
    INT32_MAX, MsaInputError, as_int64, checked_int, int_entries, is_integer_dtype, valid_blocks_from_positions,
    validate_block_size,
)

__all__ = ["MsaDecodeMetadata"]

#: cache_slots, valid_blocks, token_kv_lens, positions: int32 [max_num_tokens] each.
_PER_TOKEN_FIELDS = 4


def _checked_sizes(requests: int, tokens: int, blocks: int, draft_len: int, index_heads: int
                   ) -> tuple[int, int, int, int, int]:
    """The sizes `MsaDecodeMetadata` allocates by, checked one way for it and for `buffer_bytes`."""
    return (checked_int("max_num_requests", requests), checked_int("max_num_tokens", tokens),
            checked_int("max_blocks_per_seq", blocks), checked_int("max_draft_len", draft_len, minimum=0),
            checked_int("num_index_heads", index_heads))


def _staged_sections(r: int, t: int, m: int) -> dict[str, int]:
    """What prepare() stages, int32 entries each, for r requests, t tokens and m blocks a request:
    one block on the host and one on the device, so a step costs one host->device copy."""
    return {
        "qo_lens": r, "kv_lens": r, "kv_lens_staged": r, "qo_offsets": r, "cu_qo_lens": r + 1,
        "token_request": t, "token_intra": t, "token_live": t, "block_tables": r * m,
    }  # fmt: skip


def _host_lengths(name: str, values: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise TypeError(f"{name} must be a host sequence or CPU tensor, got a tensor on {values.device}")
        if values.dim() != 1 or not is_integer_dtype(values.dtype):
            raise MsaInputError(f"{name} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        return [int(x) for x in values.tolist()]
    return int_entries(name, values)


class MsaDecodeMetadata:
    """Step metadata shared by the MSA selector, the attention references and the cache writers.

    Per-token views (length ``num_tokens``): ``cache_slots``, ``valid_blocks``, ``token_kv_lens``,
    ``positions``, ``token_request``, ``token_intra``. Per-request views (length ``num_requests``):
    ``qo_lens``, ``kv_lens``, ``kv_lens_staged``, ``qo_offsets``; ``cu_qo_lens`` ``[R + 1]``;
    ``block_tables`` ``[R, max_blocks_per_seq]``: the caller's columns as given (a request's
    entries past its ``ceil(kv_len / B)`` pages are whatever the host padded with, often 0, and
    nothing reads them), ``-1`` past the caller's width. All int32 on ``device``.
    With ``num_pages`` (the cache's page count) ``prepare`` refuses a host block table whose
    request pages point past the cache; a device table is not checked (that would cost a sync).
    ``proxy_scores`` is fp32 scratch ``[num_index_heads, scratch_decode_tokens, max_blocks_per_seq]``
    for decode-step block scores, sized by the worst-case decode-token count; ``proxy_scratch=False``
    leaves it out (None) for a host whose kernels keep their own (TensorRT-LLM's: at 1M context a
    scratch nothing read was 128 MiB a metadata object, one per CUDA-graph batch size).
    """

    def __init__(
        self,
        max_num_requests: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str,
        *,
        max_draft_len: int = 0,
        num_index_heads: int = 1,
        num_pages: int | None = None,
        proxy_scratch: bool = True,
    ) -> None:
        (self.max_num_requests, self.max_num_tokens, self.max_blocks_per_seq, self.max_draft_len,
         self.num_index_heads) = _checked_sizes(max_num_requests, max_num_tokens, max_blocks_per_seq, max_draft_len,
                                                num_index_heads)
        self.block_size = validate_block_size(block_size)
        if self.block_size > 1 << 30:  # the derivation's int32 ops read 2**31 as -2**31 (slot 1 came out -2**31 + 1)
            raise MsaInputError(f"block_size {self.block_size} is past 2**30: the int32 positions and cache slots "
                                "are divided by it and offset within it, which wraps a larger block")
        # The last page whose every slot (page * B + offset) fits the int32 cache_slots: a larger id would wrap.
        self._max_page = (INT32_MAX + 1) // self.block_size - 1
        #: Pages in the cache the block tables index, when known: `prepare` refuses a host table's id past it.
        self.num_pages = None if num_pages is None else checked_int("num_pages", num_pages)
        if self.num_pages is not None and self.num_pages - 1 > self._max_page:  # a device table is not checked per step
            raise MsaInputError(f"num_pages {self.num_pages} at block_size {self.block_size} gives cache slots past "
                                f"int32 (page * {self.block_size} + offset): at most {self._max_page + 1} pages")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

        r, t, m = self.max_num_requests, self.max_num_tokens, self.max_blocks_per_seq
        self._layout: dict[str, slice] = {}
        start = 0
        for name, size in _staged_sections(r, t, m).items():
            self._layout[name] = slice(start, start + size)
            start += size
        pin = self.device.type == "cuda"
        self._host_fields = torch.zeros(start, dtype=torch.int32, pin_memory=pin)
        self._fields = torch.zeros(start, dtype=torch.int32, device=self.device)
        self._staging_done = torch.cuda.Event() if pin else None
        #: Bumped by every `prepare`: a caller that planned this object can tell whether anyone re-planned it since.
        self.prepare_count = 0

        def field(name: str) -> torch.Tensor:
            return self._fields[self._layout[name]]

        self._qo_lens = field("qo_lens")
        self._kv_lens = field("kv_lens")
        self._kv_lens_staged = field("kv_lens_staged")
        self._qo_offsets = field("qo_offsets")
        self._cu_qo_lens = field("cu_qo_lens")
        self._token_request = field("token_request")
        self._token_intra = field("token_intra")
        self._token_live = field("token_live")
        self._block_table_flat = field("block_tables")
        self._block_tables = self._block_table_flat.view(r, m)

        # The per-token int32 fields prepare() derives on the device (_PER_TOKEN_FIELDS of them).
        self._cache_slots = torch.full((t,), -1, dtype=torch.int32, device=self.device)
        self._valid_blocks = torch.zeros(t, dtype=torch.int32, device=self.device)
        self._token_kv_lens = torch.zeros(t, dtype=torch.int32, device=self.device)
        self._positions = torch.full((t,), -1, dtype=torch.int32, device=self.device)

        self.scratch_decode_tokens = r * (1 + self.max_draft_len)
        self.proxy_scores: torch.Tensor | None = torch.empty(
            (self.num_index_heads, self.scratch_decode_tokens, m), dtype=torch.float32, device=self.device
        ) if proxy_scratch else None

        self.num_requests = 0
        self.num_tokens = 0
        self.is_decode_only = False
        self.qo_lens_host: tuple[int, ...] = ()
        self.kv_lens_host: tuple[int, ...] = ()
        self.max_qo_len = 0
        self.max_kv_len = 0

    @staticmethod
    def buffer_bytes(
        max_num_requests: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int | None = None,
        device: torch.device | str | None = None,
        *,
        max_draft_len: int = 0,
        num_index_heads: int = 1,
        num_pages: int | None = None,
        proxy_scratch: bool = True,
    ) -> int:
        """Bytes ``__init__`` allocates for these constructor arguments, without allocating: the int32
        fields twice (host staging and device), the four per-token int32 buffers and the fp32 proxy
        scratch (with ``proxy_scratch``). ``block_size``, ``device`` and ``num_pages`` do not change
        the size. The sizes are checked as ``__init__`` checks them (a count it refuses has no size,
        not a negative one)."""
        r, t, m, max_draft_len, num_index_heads = _checked_sizes(max_num_requests, max_num_tokens, max_blocks_per_seq,
                                                                 max_draft_len, num_index_heads)
        staged = sum(_staged_sections(r, t, m).values())
        scratch = 4 * num_index_heads * r * (1 + max_draft_len) * m if proxy_scratch else 0
        return 4 * (2 * staged + _PER_TOKEN_FIELDS * t) + scratch

    # ----- per-step views -------------------------------------------------------------------
    @property
    def cache_slots(self) -> torch.Tensor:
        return self._cache_slots[: self.num_tokens]

    @property
    def cache_slots_buffer(self) -> torch.Tensor:
        """All ``max_num_tokens`` slots; entries past ``num_tokens`` are ``-1``."""
        return self._cache_slots

    @property
    def valid_blocks(self) -> torch.Tensor:
        return self._valid_blocks[: self.num_tokens]

    @property
    def token_kv_lens(self) -> torch.Tensor:
        return self._token_kv_lens[: self.num_tokens]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[: self.num_tokens]

    @property
    def token_request(self) -> torch.Tensor:
        return self._token_request[: self.num_tokens]

    @property
    def token_intra(self) -> torch.Tensor:
        return self._token_intra[: self.num_tokens]

    @property
    def qo_lens(self) -> torch.Tensor:
        return self._qo_lens[: self.num_requests]

    @property
    def kv_lens(self) -> torch.Tensor:
        return self._kv_lens[: self.num_requests]

    @property
    def kv_lens_staged(self) -> torch.Tensor:
        return self._kv_lens_staged[: self.num_requests]

    @property
    def qo_offsets(self) -> torch.Tensor:
        return self._qo_offsets[: self.num_requests]

    @property
    def cu_qo_lens(self) -> torch.Tensor:
        return self._cu_qo_lens[: self.num_requests + 1]

    @property
    def block_tables(self) -> torch.Tensor:
        return self._block_tables[: self.num_requests]

    @property
    def max_step_blocks(self) -> int:
        """Blocks covering the longest staged kv length of the step (host value, no sync)."""
        return -(-self.max_kv_len // self.block_size)

    def proxy_scores_view(self) -> torch.Tensor:
        """Decode-step slice of the proxy scratch: ``[num_index_heads, num_tokens, max_step_blocks]``."""
        if self.proxy_scores is None:
            raise MsaInputError("this metadata was built with proxy_scratch=False: it holds no proxy scratch")
        if self.num_tokens > self.scratch_decode_tokens:
            raise MsaInputError(
                f"proxy scratch holds {self.scratch_decode_tokens} decode tokens, step has {self.num_tokens}"
            )
        return self.proxy_scores[:, : self.num_tokens, : self.max_step_blocks]

    # ----- host side ------------------------------------------------------------------------
    def _validate(
        self, qo: list[int], kv: list[int], block_tables: torch.Tensor, num_context_requests: int | None
    ) -> int | None:
        """Refuse an inconsistent step; returns ``num_context_requests`` as an int (None stays None)."""
        num_requests = len(qo)
        if len(kv) != num_requests:
            raise MsaInputError(f"qo_lens has {num_requests} entries but kv_lens has {len(kv)}")
        if num_requests > self.max_num_requests:
            raise MsaInputError(f"num_requests {num_requests} exceeds max_num_requests {self.max_num_requests}")
        if not isinstance(block_tables, torch.Tensor):
            raise TypeError(f"block_tables must be a tensor, got {type(block_tables).__name__}")
        if block_tables.dim() != 2 or block_tables.shape[0] != num_requests:
            raise MsaInputError(
                f"block_tables must be [num_requests={num_requests}, W], got {tuple(block_tables.shape)}"
            )
        if not is_integer_dtype(block_tables.dtype):
            raise TypeError(f"block_tables must be an integer tensor, got {block_tables.dtype}")
        if block_tables.device.type == "meta":  # its copy failed after the new lengths were staged over the old step
            raise MsaInputError("block_tables is a meta tensor: its pages cannot be read")
        width = block_tables.shape[1]
        host_table = block_tables if block_tables.device.type == "cpu" else None
        for r, (q, k) in enumerate(zip(qo, kv)):
            if q < 0 or k < 0:
                raise MsaInputError(f"request {r}: lengths must be >= 0, got qo_len={q}, kv_len={k}")
            if k == 0 and q != 0:
                raise MsaInputError(f"request {r}: kv_len is 0 but qo_len is {q}")
            if q > k:
                raise MsaInputError(f"request {r}: qo_len {q} exceeds kv_len {k} (kv_len counts the step's tokens)")
            if k > INT32_MAX:
                raise MsaInputError(f"request {r}: kv_len {k} does not fit the metadata's int32 fields")
            pages = -(-k // self.block_size)
            if pages > self.max_blocks_per_seq:
                raise MsaInputError(
                    f"request {r}: kv_len {k} needs {pages} blocks, max_blocks_per_seq is {self.max_blocks_per_seq}"
                )
            if pages > width:
                raise MsaInputError(f"request {r}: kv_len {k} needs {pages} pages, block_tables has {width} columns")
            if host_table is not None and pages:
                self._check_pages(r, host_table[r, :pages])
        num_tokens = sum(qo)
        if num_tokens > self.max_num_tokens:
            raise MsaInputError(f"step has {num_tokens} tokens, max_num_tokens is {self.max_num_tokens}")
        if num_context_requests is None:
            return None
        count = as_int("num_context_requests", num_context_requests)
        if not 0 <= count <= num_requests:
            raise MsaInputError(f"num_context_requests {count} not in [0, {num_requests}]")
        return count

    def _check_pages(self, r: int, pages: torch.Tensor) -> None:
        """Request ``r``'s page ids in a host table (one min and one max a request, per step):
        mapped, within int32 cache slots and, when known, within the cache."""
        pages = as_int64(f"block_tables row {r}", pages)  # torch has no min / max of uint16/32/64 tensors
        lowest, highest = int(pages.min()), int(pages.max())
        if lowest < 0:
            raise MsaInputError(f"request {r}: block_tables has an unmapped page (< 0) among its first {len(pages)}")
        if highest > self._max_page:
            raise MsaInputError(
                f"request {r}: block_tables has a page id past int32 cache slots (page * {self.block_size} "
                f"+ offset must fit int32: page <= {self._max_page}) among its first {len(pages)}"
            )
        if self.num_pages is not None and highest >= self.num_pages:
            column = int((pages >= self.num_pages).nonzero()[0, 0])
            raise MsaInputError(
                f"request {r}: block_tables[{r}, {column}] is page {int(pages[column])}, past the "
                f"cache's {self.num_pages} pages"
            )

    def prepare(
        self,
        qo_lens: torch.Tensor | Sequence[int],
        kv_lens: torch.Tensor | Sequence[int],
        block_tables: torch.Tensor,
        *,
        num_context_requests: int | None = None,
    ) -> None:
        """Stage one step: host lengths, a block table ``[R, >=blocks]`` (CPU or device).

        ``kv_lens`` already count the step's tokens and may be optimistic (full acceptance);
        ``on_update_kv_lens`` can shrink them later. A step is decode-only when no row is a
        context row: by default rows with ``qo_len <= 1 + max_draft_len`` are decode rows, or the
        host says how many leading rows are context rows via ``num_context_requests``. A
        decode-only step must fit the proxy scratch.
        """
        qo = _host_lengths("qo_lens", qo_lens)
        kv = _host_lengths("kv_lens", kv_lens)
        # as an int: a NumPy or 0-d tensor count made is_decode_only one too (a device read at every test)
        num_context_requests = self._validate(qo, kv, block_tables, num_context_requests)
        num_requests, num_tokens = len(qo), sum(qo)
        if num_context_requests is None:
            decode_only = num_requests > 0 and all(q <= 1 + self.max_draft_len for q in qo)
        else:
            decode_only = num_requests > 0 and num_context_requests == 0
        if decode_only and num_tokens > self.scratch_decode_tokens:
            raise MsaInputError(
                f"decode-only step has {num_tokens} query tokens but the proxy scratch holds "
                f"{self.scratch_decode_tokens} (max_num_requests x (1 + max_draft_len)); raise max_draft_len"
            )

        # Counted before anything is staged: a prepare cut off half way (a Ctrl-C) has changed the buffers,
        # and a caller that skips re-planning an unchanged count would read them as its own plan.
        self.prepare_count += 1
        if self._staging_done is not None:
            self._staging_done.synchronize()  # the previous step's copy may still read the pinned buffer
        host = self._host_fields
        host.zero_()
        lay = self._layout
        if num_requests:
            qo_t = torch.tensor(qo, dtype=torch.int32)
            kv_t = torch.tensor(kv, dtype=torch.int32)
            host[lay["qo_lens"]][:num_requests] = qo_t
            host[lay["kv_lens"]][:num_requests] = kv_t
            host[lay["kv_lens_staged"]][:num_requests] = kv_t
            host[lay["cu_qo_lens"]][1 : num_requests + 1] = torch.cumsum(qo_t, 0)
        if num_tokens:
            request_ids = torch.repeat_interleave(torch.arange(num_requests, dtype=torch.int32), qo_t)
            first = torch.cumsum(qo_t, 0) - qo_t
            host[lay["token_request"]][:num_tokens] = request_ids
            host[lay["token_intra"]][:num_tokens] = torch.arange(num_tokens, dtype=torch.int32) - first[request_ids]
            host[lay["token_live"]][:num_tokens] = 1
        host_tables = host[lay["block_tables"]].view(self.max_num_requests, self.max_blocks_per_seq)
        host_tables.fill_(-1)
        columns = min(block_tables.shape[1], self.max_blocks_per_seq)
        table_on_host = block_tables.device.type == "cpu"
        if table_on_host and num_requests:
            host_tables[:num_requests, :columns] = block_tables[:, :columns].to(torch.int32)
        elif num_requests and block_tables.untyped_storage().data_ptr() == self._fields.untyped_storage().data_ptr():
            block_tables = block_tables.clone()  # our own table passed back: the staging copy would blank it first

        self._fields.copy_(host, non_blocking=self._staging_done is not None)
        if self._staging_done is not None:
            # the copy's stream, not the current device's
            self._staging_done.record(torch.cuda.current_stream(self.device))
        if not table_on_host and num_requests:
            self._block_tables[:num_requests, :columns].copy_(block_tables[:, :columns])

        self.num_requests, self.num_tokens = num_requests, num_tokens
        self.is_decode_only = decode_only
        self.qo_lens_host, self.kv_lens_host = tuple(qo), tuple(kv)
        self.max_qo_len = max(qo, default=0)
        self.max_kv_len = max(kv, default=0)
        self._derive_token_fields()

    # ----- device side ----------------------------------------------------------------------
    def _derive_token_fields(self) -> None:
        """Recompute per-token fields from ``kv_lens`` with fixed shapes and no host sync."""
        block = self.block_size
        torch.minimum(self._kv_lens, self._kv_lens_staged, out=self._kv_lens)
        self._kv_lens.clamp_(min=0)
        torch.sub(self._kv_lens, self._qo_lens, out=self._qo_offsets)
        request = self._token_request
        live = self._token_live.bool()
        position = self._qo_offsets.index_select(0, request) + self._token_intra
        position = torch.where(live, position, torch.full_like(position, -1))
        self._positions.copy_(position)
        kv_len = (position + 1).clamp(min=0)
        self._token_kv_lens.copy_(kv_len)
        self._valid_blocks.copy_(valid_blocks_from_positions(position, block))
        column = torch.div(position.clamp(min=0), block, rounding_mode="floor").clamp(max=self.max_blocks_per_seq - 1)
        page = self._block_table_flat.index_select(0, request * self.max_blocks_per_seq + column)
        slot = page * block + torch.remainder(position, block)
        writable = live & (position >= 0) & (page >= 0)
        self._cache_slots.copy_(torch.where(writable, slot, torch.full_like(slot, -1)))

    def on_update_kv_lens(self, kv_lens: torch.Tensor | None = None) -> None:
        """Re-derive slots, counts and positions after a device-side kv-length correction.

        ``kv_lens`` (device int ``[num_requests]``, any stride), when given, replaces the current lengths.
        The result is clamped to the lengths staged by ``prepare`` (corrections only shrink).
        Device ops only, fixed shapes, idempotent: safe under CUDA-graph capture. A no-op when
        speculative decoding is off (``max_draft_len == 0``) and no ``kv_lens`` is given.
        """
        if kv_lens is None:
            if self.max_draft_len == 0:
                return
        else:
            if not isinstance(kv_lens, torch.Tensor):
                raise TypeError(f"kv_lens must be a device tensor, got {type(kv_lens).__name__}")
            if kv_lens.dim() != 1 or kv_lens.shape[0] != self.num_requests:
                raise MsaInputError(f"kv_lens must be [num_requests={self.num_requests}], got {tuple(kv_lens.shape)}")
            if not is_integer_dtype(kv_lens.dtype):
                raise TypeError(f"kv_lens must be an integer tensor, got {kv_lens.dtype}")
            if kv_lens.device != self.device:  # the index too: cuda:1 lengths for cuda:0 metadata
                raise MsaInputError(f"kv_lens is on {kv_lens.device} but the metadata lives on {self.device}")
        fused = self._fused_kv_lens_update()
        if fused is not None:  # the kernel reads kv_lens densely: a strided view (lens[:, 0]) as the torch ops take it
            fused(self, None if kv_lens is None else kv_lens.contiguous())
            return
        if kv_lens is not None:  # clamped while still wide: an int64 past int32 must not wrap first
            staged = self._kv_lens_staged[: self.num_requests]
            wide = as_int64("kv_lens", kv_lens)  # torch promotes no uint16/32/64 with the int32 lengths
            self._kv_lens[: self.num_requests].copy_(torch.minimum(wide, staged).clamp_(min=0))
        self._derive_token_fields()

    def _fused_kv_lens_update(self):
        """The one-launch Triton twin of `_derive_token_fields` on capable CUDA devices, else None."""
        if self.device.type != "cuda":
            return None
        from m3_eagle_plugin.msa import kernels

        if not kernels.use_triton(self.device):
            return None
        from m3_eagle_plugin.msa.kernels.kv_lens_update import on_update_kv_lens_fused

        return on_update_kv_lens_fused
