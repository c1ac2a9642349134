"""Send a request's KV pages (`kv.transfer.KVTransferPayload`) from one rank to another.

Disaggregated serving prefills on a context GPU and decodes on a generation GPU; the payload
carries every pool's slots of the request, so the target layers' K/V, the index-K pages and the
shared draft layer travel together. Tensors only (no pickles), through ``comm_device`` so the
same calls work over gloo (CPU) and NCCL (GPU).

Wire format, version 3 (every message int64 unless said otherwise)
-------------------------------------------------------------------
A *frame* is two messages::

    preamble  [MAGIC, VERSION, KIND, N]      MAGIC = int.from_bytes(b"M3EAGLE", "big")
    body      [v_0, ..., v_{N-1}, TRAILER]   TRAILER = -MAGIC, so a short body is caught

KIND: 1 a list of ints (`send_ints`), 2 a KV payload header, 3 a handoff header
(`parallel.disagg`), 4 a verdict, 5 page checksums, 6 a framing abort. A KV payload
(`send_payload`) is::

    sender -> receiver  frame 2: [num_tokens, num_pools, (pages, sub_pages, page_bytes) per pool,
                                  fingerprint length, the fingerprint's UTF-8 bytes, one per int]
    receiver -> sender  frame 4: empty = accepted, else the refusal's reason in UTF-8 bytes
    sender -> receiver  accepted only: each pool's uint8 pages (a pool with no bytes is skipped),
                        then frame 5: the zlib CRC-32 of every page, pool by pool, page by page
    receiver -> sender  frame 4 again: empty = the pages arrived whole, else the reason

A page whose CRC-32 differs on arrival is refused by the receiver, naming the pool and page, and
the final verdict carries that reason back, so both sides raise (the framing is intact, so the
stream stays in step). Version 2 had no final verdict: its sender never heard of damaged pages.
CRC-32 runs at about memory-copy speed on the host, where both ends hold the pages anyway.

A handoff is the same with frame 3, whose body is the request's state followed by the body of
frame 2 (see `parallel.disagg`). The receiver checks the whole header (sizes, counts, and, when
given the receiving cache or engine, geometry and state) and allocates the page buffers before
it answers, so a refused header never sends its pages: both sides raise, naming the cause, and
the next frame on the stream is the next header. The preamble, a header frame and its verdict
are what every version keeps, so a peer speaking another version is refused by name.

A frame that is not ours (wrong magic), announces an absurd length or arrives short leaves the
position in the stream unknown: the receiver raises `TransferError`, and every later message
to or from that peer in that process group is refused at once (start a new group) rather than
payload bytes being read as a header. So is a stream that broke in the middle of the pages, and
one whose exchange was cut off part-way on this side (an interrupt between two messages).
When the broken frame was a header or the page checksums, whose sender waits for a verdict, the
receiver answers with frame 6 (the cause in UTF-8 bytes) instead: the sender raises at once and
marks the stream out of sync too, rather than waiting for its timeout.

Ranks that receive together (the ranks of a tensor-parallel group, each receiving its own
shard's pages of the same request from its own sender) must accept or refuse together: one rank
holding a request its peers refused leaves their all-reduces summing other requests' partial
sums (wrong tokens without a word) or messages of other sizes (gloo aborts the process). An
`Agreement` over their process group settles each verdict before it is answered: every rank
contributes one row ``[stage, key, refused, n, the reason's first n UTF-8 bytes]`` (int64, at
most ``AGREEMENT_REASON_BYTES``) of a ``[group size, 4 + AGREEMENT_REASON_BYTES]`` tensor, the
rows are summed (all-reduce, each rank filling only its own), and every rank then refuses its
sender when any rank refused or the ranks hold different keys (requests), naming those ranks and
their reasons. A rank whose receive failed before its vote (a broken stream) still votes a
refusal, so its peers are not left waiting for the group's timeout.
"""
from __future__ import annotations

import contextlib
import weakref
import zlib
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from m3_eagle_plugin._ints import as_int
from m3_eagle_plugin.kv.manager import PagedKVCache
from m3_eagle_plugin.kv.transfer import KVTransferPayload, cache_fingerprint, fingerprint_difference
from m3_eagle_plugin.parallel.process_group import comm_device

__all__ = ["send_payload", "recv_payload", "send_ints", "recv_ints", "check_sendable", "as_ints",
           "TransferError", "PayloadHeader", "MAGIC", "VERSION", "TRAILER", "KIND_INTS", "KIND_PAYLOAD",
           "KIND_HANDOFF", "KIND_VERDICT", "KIND_CHECKSUMS", "KIND_ABORT", "page_checksums", "Agreement",
           "AGREEMENT_REASON_BYTES", "check_fingerprint"]

MAGIC = int.from_bytes(b"M3EAGLE", "big")
VERSION = 3
TRAILER = -MAGIC
KIND_INTS, KIND_PAYLOAD, KIND_HANDOFF, KIND_VERDICT, KIND_CHECKSUMS, KIND_ABORT = 1, 2, 3, 4, 5, 6
_KIND_NAMES = {KIND_INTS: "list of ints", KIND_PAYLOAD: "KV payload header", KIND_HANDOFF: "handoff header",
               KIND_VERDICT: "verdict", KIND_CHECKSUMS: "page checksums", KIND_ABORT: "framing abort"}
_WAITS_FOR_VERDICT = (KIND_PAYLOAD, KIND_HANDOFF)  # headers: a refusal keeps the stream in step
_AWAITS_ANSWER = (*_WAITS_FOR_VERDICT, KIND_CHECKSUMS)  # frames whose sender waits for frame 4 or 6

# Limits past which a size is refused as absurd (not a plausible request), before any allocation.
MAX_FRAME_INTS = 1 << 24
MAX_FINGERPRINT_BYTES = 1 << 16
MAX_POOLS = 1 << 10
MAX_PAYLOAD_BYTES = 1 << 40
_MAX_REASON_BYTES = 4096
AGREEMENT_REASON_BYTES = 512  # of each rank's refusal reason, in the `Agreement`

T = TypeVar("T")


class TransferError(ValueError):
    """A message that is malformed or does not fit the receiver, or a stream that is out of sync."""


# ----- stream state: a peer whose stream lost its framing is refused from then on -------------
_out_of_sync: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, str]]" = weakref.WeakKeyDictionary()


def _group_key(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    if not dist.is_initialized():  # WORLD is None then: the stream state's weak reference to it failed first
        raise RuntimeError("the KV transfer needs an initialised torch.distributed process group "
                           "(init_process_group, or parallel.process_group.init_local_group)")
    return dist.group.WORLD


def _lose_sync(group: dist.ProcessGroup | None, peer: int, message: str) -> TransferError:
    _out_of_sync.setdefault(_group_key(group), {}).setdefault(peer, message)
    return TransferError(message)


def _check_in_sync(group: dist.ProcessGroup | None, peer: int) -> None:
    cause = _out_of_sync.get(_group_key(group), {}).get(peer)
    if cause is not None:
        raise TransferError(f"the stream with rank {peer} is out of sync (earlier: {cause}); nothing more "
                            f"can be exchanged with it in this process group, start a new one")


@contextlib.contextmanager
def _whole(group: dist.ProcessGroup | None, peer: int, what: str, keep: type[Exception] = TransferError):
    """Messages that travel together: cut off between them (Ctrl-C, an error off the wire), the
    peer's position in the stream is unknown, so the stream is marked out of sync. ``keep``: errors
    raised in step (a `TransferError` marks the stream itself where it must)."""
    try:
        yield
    except (TransferError, keep):
        raise
    except BaseException as error:
        _lose_sync(group, peer, f"{what} was cut off part-way ({type(error).__name__})")
        raise


def _send_tensor(tensor: torch.Tensor, dst: int, group, what: str) -> None:
    try:
        dist.send(tensor, dst, group=group)
    except RuntimeError as error:
        raise _lose_sync(group, dst, f"sending {what} to rank {dst} failed: {error}") from error


def _recv_tensor(tensor: torch.Tensor, src: int, group, what: str) -> None:
    try:
        dist.recv(tensor, src, group=group)
    except RuntimeError as error:
        raise _lose_sync(group, src, f"the stream from rank {src} broke while receiving {what}: {error}") from error


# ----- frames ---------------------------------------------------------------------------------
def _send_frame(kind: int, values: list[int], dst: int, group) -> None:
    _check_in_sync(group, dst)
    if len(values) > MAX_FRAME_INTS:
        raise TransferError(f"a {_KIND_NAMES[kind]} holding {len(values)} ints is over the "
                            f"{MAX_FRAME_INTS} limit")
    device = comm_device(group)
    name = _KIND_NAMES[kind]
    try:  # both built before the first send: a value past int64 must not strand a sent preamble
        preamble = torch.tensor([MAGIC, VERSION, kind, len(values)], dtype=torch.int64, device=device)
        body = torch.tensor([*values, TRAILER], dtype=torch.int64, device=device)
    except (RuntimeError, OverflowError, ValueError) as error:  # torch 2.13: ValueError past int64
        raise TransferError(f"a {name} holds a value that is not an int64: {error}") from None
    with _whole(group, dst, f"sending the {name}"):
        _send_tensor(preamble, dst, group, f"a {name} preamble")
        _send_tensor(body, dst, group, f"a {name}")


def _recv_frame(src: int, group) -> tuple[int, int, list[int]]:
    """(kind, version, values) of the next frame from ``src``; raises (and marks the stream out of
    sync) when its framing cannot be trusted. Version and kind are the caller's to check."""
    _check_in_sync(group, src)
    device = comm_device(group)
    preamble = torch.zeros(4, dtype=torch.int64, device=device)
    # inside: Ctrl-C while waiting for the preamble is raised once it arrived (the wait is not cut short)
    with _whole(group, src, "receiving a frame"):
        _recv_tensor(preamble, src, group, "a frame preamble")
        magic, version, kind, n = preamble.cpu().tolist()
        if magic != MAGIC:
            raise _lose_sync(group, src, f"rank {src} is not speaking the m3-eagle transfer protocol: the frame "
                                         f"starts with {magic:#x}, expected the magic {MAGIC:#x}")
        if not 0 <= n <= MAX_FRAME_INTS:
            raise _lose_sync(group, src, f"rank {src} announced a frame of {n} ints (allowed: 0 to {MAX_FRAME_INTS})")
        body = torch.zeros(n + 1, dtype=torch.int64, device=device)
        _recv_tensor(body, src, group, f"a frame of {n} ints")
    values = body.cpu().tolist()
    if values[-1] != TRAILER:
        cause = (f"the frame of {n} ints from rank {src} arrived truncated or corrupt "
                 f"(its trailer is {values[-1]:#x}, expected {TRAILER:#x})")
        raise _lose_step(group, src, kind, cause)
    return kind, version, values[:-1]


def _lose_step(group, peer: int, kind: int, cause: str) -> TransferError:
    """`_lose_sync`, first telling ``peer`` (frame 6) when it waits for an answer to its frame of
    ``kind``: otherwise it would wait for its timeout."""
    if kind in _AWAITS_ANSWER:
        _abort(cause, peer, group)
    return _lose_sync(group, peer, cause)


def _abort(cause: str, peer: int, group) -> None:
    """Tell ``peer``, which waits for a verdict, that its frame lost the framing (best effort)."""
    try:
        _send_frame(KIND_ABORT, _utf8(cause, _MAX_REASON_BYTES), peer, group)
    except TransferError:
        pass  # the peer is gone (the stream is marked): the framing error is still the news here


def _check_frame(kind: int, version: int, expected: int, peer: int) -> None:
    if version != VERSION:
        raise TransferError(f"rank {peer} speaks transfer protocol version {version}, this side speaks {VERSION}")
    if kind != expected:
        raise TransferError(f"expected a {_KIND_NAMES[expected]} from rank {peer}, got a "
                            f"{_KIND_NAMES.get(kind, f'frame of unknown kind {kind}')}")


def _utf8(text: str, limit: int) -> list[int]:
    """``text``'s UTF-8 bytes, cut to ``limit`` at a character boundary (so the cut still decodes)."""
    return list(text.encode("utf-8")[:limit].decode("utf-8", "ignore").encode("utf-8"))


def _decode_utf8(values: list[int], what: str) -> str:
    bad = [v for v in values if not 0 <= v <= 255]
    if bad:
        raise TransferError(f"{what} holds values outside a byte: {bad[:5]}")
    try:
        return bytes(values).decode("utf-8")
    except UnicodeDecodeError as error:
        raise TransferError(f"{what} is not valid UTF-8: {error}") from None


def _reason_text(values: list[int]) -> str:
    try:
        return _decode_utf8(values, "the reason")
    except TransferError as error:
        return str(error)


def send_header(kind: int, values: list[int], dst: int, group, what: str,
                error: type[Exception] = TransferError) -> None:
    """Send a header frame and wait for the receiver's verdict; a refusal raises ``error`` with the
    receiver's reason (nothing else was sent, so the stream is still in step)."""
    _send_frame(kind, values, dst, group)
    # the receiver answers, then waits for this header's pages: cut off here, the next send would be read as them
    with _whole(group, dst, f"waiting for the verdict on the {what}", keep=error):
        _await_verdict(dst, group, what, error)


def _await_verdict(dst: int, group, what: str, error: type[Exception]) -> None:
    """The receiver's verdict on what was just sent: a refusal raises ``error`` with its reason."""
    got, version, reason = _recv_frame(dst, group)
    if got == KIND_ABORT:
        raise _lose_sync(group, dst, f"rank {dst} lost the framing of the {what}: {_reason_text(reason)}")
    try:
        _check_frame(got, version, KIND_VERDICT, dst)
    except TransferError as mismatch:  # the peer is not answering: position unknown
        raise _lose_sync(group, dst, f"no verdict on the {what}: {mismatch}") from None
    if reason:
        raise error(f"rank {dst} refused the {what}: {_decode_utf8(reason, 'the refusal reason')}")


def recv_header(kind: int, src: int, group, accept: Callable[[list[int]], T]) -> T:
    """Receive a header frame of ``kind``, run ``accept`` on its values (checks, buffer allocation)
    and answer the sender: any exception from it is sent back as the refusal's reason and raised
    here; the sender then sends nothing more for this header."""
    got, version, values = _recv_frame(src, group)
    try:
        _check_frame(got, version, kind, src)
        result = accept(values)
    except Exception as refusal:
        if got in _WAITS_FOR_VERDICT:
            _refuse(refusal, src, group)
        else:  # another frame where a header belongs: the stream is out of step
            _lose_step(group, src, got, f"expected a {_KIND_NAMES[kind]} from rank {src}, got a "
                                        f"{_KIND_NAMES.get(got, f'frame of unknown kind {got}')}")
        raise
    except BaseException as error:  # cut off (Ctrl-C) between the header and its verdict
        _lose_sync(group, src, f"answering a {_KIND_NAMES[kind]} was cut off part-way ({type(error).__name__})")
        raise
    _send_frame(KIND_VERDICT, [], src, group)
    return result


def _refuse(refusal: Exception, src: int, group) -> None:
    """Answer a frame from ``src`` whose sender waits for a verdict with a refusal."""
    try:
        _send_frame(KIND_VERDICT, _utf8(str(refusal) or type(refusal).__name__, _MAX_REASON_BYTES), src, group)
    except TransferError:
        pass  # the peer is gone (the stream is marked): the refusal is still the news here


# ----- int lists ------------------------------------------------------------------------------
def as_ints(values) -> list[int]:
    """``values`` as Python ints; a float or bool raises TypeError (an int64 tensor would truncate it silently)."""
    return [as_int(f"ints[{i}]", v) for i, v in enumerate(values)]


def send_ints(values: list[int], dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send a list of ints (one frame) to rank ``dst``."""
    _send_frame(KIND_INTS, as_ints(values), dst, group)


def recv_ints(src: int, group: dist.ProcessGroup | None = None) -> list[int]:
    """Receive what `send_ints` sent from rank ``src``."""
    kind, version, values = _recv_frame(src, group)
    try:
        _check_frame(kind, version, KIND_INTS, src)
    except TransferError as mismatch:
        if kind in _WAITS_FOR_VERDICT:  # its sender waits for a verdict: refuse it, the stream stays in step
            _refuse(mismatch, src, group)
            raise
        raise _lose_step(group, src, kind, str(mismatch)) from None
    return values


# ----- KV payload headers ---------------------------------------------------------------------
@dataclass(frozen=True)
class PayloadHeader:
    """What a KV payload header announces: checked for sanity when parsed, before any page moves."""

    fingerprint: str
    num_tokens: int
    shapes: tuple[tuple[int, int, int], ...]

    def to_ints(self) -> list[int]:
        data = list(self.fingerprint.encode("utf-8"))
        return [self.num_tokens, len(self.shapes), *(x for s in self.shapes for x in s), len(data), *data]

    @classmethod
    def of(cls, payload: KVTransferPayload) -> "PayloadHeader":
        return cls(payload.fingerprint, payload.num_tokens,
                   tuple(tuple(int(x) for x in pages.shape) for pages in payload.pool_pages))

    @classmethod
    def parse(cls, values: list[int], where: str) -> "PayloadHeader":
        """Parse a header body that must be exactly ``values``; raises `TransferError` naming the field."""
        if len(values) < 3:
            raise TransferError(f"{where}: the KV payload header has {len(values)} ints, needs at least 3")
        num_tokens, num_pools = values[0], values[1]
        if num_tokens < 0:
            raise TransferError(f"{where}: num_tokens {num_tokens} is negative")
        if not 0 <= num_pools <= MAX_POOLS:
            raise TransferError(f"{where}: {num_pools} pools (allowed: 0 to {MAX_POOLS})")
        fp_at = 2 + 3 * num_pools
        if len(values) <= fp_at:
            raise TransferError(f"{where}: {num_pools} pools announced, the header ends before their "
                                f"{3 * num_pools} shape entries and the fingerprint length")
        shapes = tuple(tuple(values[2 + 3 * i: 5 + 3 * i]) for i in range(num_pools))
        fp_len = values[fp_at]
        if not 1 <= fp_len <= MAX_FINGERPRINT_BYTES:
            raise TransferError(f"{where}: fingerprint length {fp_len} (allowed: 1 to {MAX_FINGERPRINT_BYTES})")
        if len(values) != fp_at + 1 + fp_len:
            raise TransferError(f"{where}: the header announces {fp_at + 1 + fp_len} ints "
                                f"({num_pools} pools, a {fp_len}-byte fingerprint) but carries {len(values)}")
        header = cls(_decode_utf8(values[fp_at + 1:], f"{where}: the fingerprint"), num_tokens, shapes)
        header.check_sizes(where)
        return header

    def check_sizes(self, where: str) -> None:
        """Sizes every payload must have whoever receives it: non-negative, the same number of pages
        in every pool (one slot each), page checksums that fit one frame, and a total a host could
        plausibly hold."""
        for i, shape in enumerate(self.shapes):
            if len(shape) != 3 or any(x < 0 for x in shape):
                raise TransferError(f"{where}: pool {i} pages have shape {shape}, expected 3 sizes >= 0")
        if len({s[0] for s in self.shapes}) > 1:
            raise TransferError(f"{where}: the pools carry different page counts {[s[0] for s in self.shapes]} "
                                f"(a request has one page of each pool per slot)")
        total = sum(a * b * c for a, b, c in self.shapes)
        if total > MAX_PAYLOAD_BYTES:
            raise TransferError(f"{where}: the pages would take {total} bytes (limit {MAX_PAYLOAD_BYTES})")
        # the checksums frame follows the pages: over its limit, it would fail after every page went out
        checksums = sum(s[0] for s in self.shapes)
        if checksums > MAX_FRAME_INTS:
            raise TransferError(f"{where}: {checksums} pages (pool by pool) are more page checksums than one frame "
                                f"carries ({MAX_FRAME_INTS})")

    def check_fits(self, cache: PagedKVCache, where: str) -> None:
        """Refuse a header whose pages do not fit ``cache``: another geometry, a page count that
        does not match ``num_tokens`` in this cache's block size, or more pages than are free now."""
        check_fingerprint(self.fingerprint, cache, where)
        needed = cache.allocator.blocks_for(self.num_tokens)
        shapes = tuple((needed, p.sub_pages, p.page_bytes) for p in cache.geometry.pools)
        if self.shapes != shapes:
            raise TransferError(f"{where}: pages of shape {list(self.shapes)} do not match this cache's "
                                f"{list(shapes)} for {self.num_tokens} tokens")
        if needed > cache.num_blocks:
            raise TransferError(f"{where}: {needed} pages, this cache has {cache.num_blocks}")
        if needed > cache.num_free_blocks:  # `import_request` refuses it too, after every page crossed
            raise TransferError(f"{where}: {needed} pages, {cache.num_free_blocks} of this cache's "
                                f"{cache.num_blocks} are free")

    def buffers(self, device: torch.device, where: str) -> list[torch.Tensor]:
        """Zeroed receive buffers, allocated before the header is accepted (a failure refuses it)."""
        try:
            return [torch.zeros(shape, dtype=torch.uint8, device=device) for shape in self.shapes]
        except RuntimeError as error:
            raise TransferError(f"{where}: cannot allocate the {len(self.shapes)} page buffers: {error}") from None


def check_fingerprint(fingerprint: str, cache: PagedKVCache, where: str) -> None:
    """Refuse pages of another cache geometry than ``cache``'s, naming the fields that differ."""
    if not isinstance(fingerprint, str):
        raise TransferError(f"{where}: the pages' geometry fingerprint must be a str, got {type(fingerprint).__name__}")
    expected = cache_fingerprint(cache)
    if fingerprint != expected:
        raise TransferError(f"{where}: the KV geometry differs from this cache's in "
                            f"{fingerprint_difference(fingerprint, expected)}")


def stage_pages(pool_pages, group) -> list[torch.Tensor]:
    """The pages as `send_pages` sends them (contiguous, on ``group``'s device): made before the
    header goes out, so a copy that fails (out of memory, a meta tensor) fails before any message
    instead of after the receiver accepted and waits for pages (it would read the next frame as them)."""
    device = comm_device(group)
    return [pages.contiguous().to(device) for pages in pool_pages]


def page_checksums(pool_pages) -> list[int]:
    """zlib CRC-32 of every page (uint8 ``[pages, sub_pages, page_bytes]`` per pool), pool by pool."""
    sums = []
    for pages in pool_pages:
        host = pages.detach().contiguous().cpu().numpy()
        sums.extend(zlib.crc32(page) for page in host)
    return sums


def send_pages(staged: list[torch.Tensor], checksums: list[int], dst: int, group, what: str) -> None:
    """Send what `stage_pages` made and its `page_checksums`, after the receiver accepted the header,
    and wait for its final verdict: pages it refused (damaged in transit) raise `TransferError`."""
    with _whole(group, dst, f"sending the pages of the {what}"):
        for i, pages in enumerate(staged):
            if pages.numel():
                _send_tensor(pages, dst, group, f"pool {i} of the {what}")
        _send_frame(KIND_CHECKSUMS, checksums, dst, group)
        _await_verdict(dst, group, f"pages of the {what}", TransferError)


def recv_pages(buffers: list[torch.Tensor], src: int, group, what: str,
               agree: Callable[[Exception | None], None] | None = None) -> tuple[torch.Tensor, ...]:
    """Receive the pages `send_pages` sent into ``buffers`` and answer its final verdict; a page
    whose checksum differs raises `TransferError` naming it, here and, through the verdict, in the
    sender (the stream stays in step). ``agree`` (this rank's refusal or None) settles the verdict
    with the ranks receiving together first: it raises the group's refusal."""
    with _whole(group, src, f"receiving the pages of the {what}"):
        for i, pages in enumerate(buffers):
            if pages.numel():
                _recv_tensor(pages, src, group, f"pool {i} of {len(buffers)} of the {what}")
        kind, version, expected = _recv_frame(src, group)
    try:
        _check_frame(kind, version, KIND_CHECKSUMS, src)
    except TransferError as mismatch:  # whatever came instead, its sender is not where we are
        raise _lose_step(group, src, kind, f"after the pages of the {what}: {mismatch}") from None
    with _whole(group, src, f"answering the pages of the {what}"):
        received = tuple(pages.cpu() for pages in buffers)
        try:
            try:
                _check_checksums(received, expected, what)
            except TransferError as damaged:
                if agree is not None:
                    agree(damaged)
                raise
            if agree is not None:
                agree(None)
        except TransferError as refused:
            _refuse(refused, src, group)
            raise
    _send_frame(KIND_VERDICT, [], src, group)
    return received


def _check_checksums(pool_pages: tuple[torch.Tensor, ...], expected: list[int], what: str) -> None:
    got = page_checksums(pool_pages)
    if len(expected) != len(got):
        raise TransferError(f"the {what} carries {len(expected)} page checksums for its {len(got)} pages")
    num_pages = int(pool_pages[0].shape[0]) if pool_pages else 0
    for at, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            pool, page = divmod(at, num_pages)
            raise TransferError(f"the {what}: page {page} of pool {pool} arrived corrupt (CRC-32 "
                                f"{have:#010x}, the sender's {want:#010x})")


# ----- verdicts settled by the ranks that receive together -----------------------------------
class Agreement:
    """The verdicts of the ranks of ``group`` that receive one transfer together, stage by stage
    (module docstring): after `vote`, they all accept or all refuse."""

    def __init__(self, group: dist.ProcessGroup, what: str):
        # checked before any message: its peers would wait for this rank's votes until their timeout
        if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gave a non-member
            raise ValueError("this process is not a member of the agree process group")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"agree must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        if dist.get_rank(group) < 0:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not a member of the agree process group")
        self.group, self.what = group, what
        self.voted = 0  # stages voted on (a vote is never repeated, even one whose all-reduce failed)

    def vote(self, stage: int, key: int, refusal: Exception | None, error: type[Exception]) -> None:
        """This rank's verdict (``refusal`` or None) on ``stage`` of the transfer of ``key`` (a
        request index); raises ``refusal`` when this rank refused, else ``error`` naming the ranks
        that refused (or that hold another key); returns when every rank accepted."""
        self.voted = stage
        me, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        reason = _utf8(str(refusal) or type(refusal).__name__, AGREEMENT_REASON_BYTES) if refusal is not None else []
        rows = torch.zeros(size, 4 + AGREEMENT_REASON_BYTES, dtype=torch.int64)
        rows[me, :4 + len(reason)] = torch.tensor([stage, key, int(refusal is not None), len(reason), *reason])
        rows = rows.to(comm_device(self.group))
        try:
            dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as failed:  # a rank died or never voted: refused, naming that
            if refusal is not None:
                raise refusal from None
            raise error(f"{self.what}: the receiving ranks could not agree on it (rank {me} of the agree "
                        f"group; a rank died or did not vote within the group's timeout): {failed}") from failed
        if refusal is not None:
            raise refusal
        table = rows.cpu().tolist()
        stages = {r: row[0] for r, row in enumerate(table) if row[0] != stage}
        if stages:
            raise error(f"{self.what}: the receiving ranks are at different stages of it (this rank {me} at "
                        f"{stage}, {', '.join(f'rank {r} at {s}' for r, s in stages.items())})")
        refused = [f"rank {r} refused it: {_reason_text(row[4:4 + max(0, min(row[3], AGREEMENT_REASON_BYTES))])}"
                   for r, row in enumerate(table) if row[2]]
        if refused:
            raise error(f"{self.what}: refused with the receiving ranks of the agree group: {'; '.join(refused)}")
        keys = [row[1] for row in table]
        if len(set(keys)) > 1:
            raise error(f"{self.what}: the receiving ranks got different requests "
                        f"({', '.join(f'rank {r}: {k}' for r, k in enumerate(keys))}); every rank must "
                        f"receive the same request at once")

    def vote_refusal(self, stage: int, key: int, refusal: Exception) -> None:
        """After ``refusal`` cut this rank's receive short, its refusal of ``stage`` if not voted yet:
        the other ranks are waiting for it (they refuse too)."""
        if self.voted < stage:
            try:
                self.vote(stage, key, refusal, type(refusal))
            except Exception:  # noqa: BLE001 - the refusal that cut the receive short is the news here
                pass


# ----- KV payloads ----------------------------------------------------------------------------
def check_sendable(payload: KVTransferPayload) -> None:
    """Refuse, before the first message, what `recv_payload` would refuse or misread. A non-int
    token count would be truncated by the int64 header without a word."""
    if not isinstance(payload, KVTransferPayload):
        raise TypeError(f"payload must be a KVTransferPayload, got {type(payload).__name__}")
    if not isinstance(payload.fingerprint, str):
        raise TypeError(f"payload fingerprint must be a str, got {type(payload.fingerprint).__name__}")
    if not payload.fingerprint:
        raise ValueError("payload has an empty geometry fingerprint")
    if len(payload.fingerprint.encode("utf-8")) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"payload fingerprint is over {MAX_FINGERPRINT_BYTES} bytes")
    as_int("payload num_tokens", payload.num_tokens, 0)
    if len(payload.pool_pages) > MAX_POOLS:
        raise ValueError(f"payload has {len(payload.pool_pages)} pools, at most {MAX_POOLS} travel")
    for pages in payload.pool_pages:
        if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 3:
            raise ValueError(f"payload pages must be uint8 [pages, sub_pages, page_bytes] tensors, got "
                             f"{getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}")
    try:
        PayloadHeader.of(payload).check_sizes("payload")
    except TransferError as error:
        raise ValueError(str(error)) from None


def send_payload(payload: KVTransferPayload, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``payload`` to rank ``dst``; raises `TransferError` with the receiver's reason when it
    refuses the header (then no page was sent) or a page that arrived damaged."""
    check_sendable(payload)
    staged = stage_pages(payload.pool_pages, group)
    checksums = page_checksums(payload.pool_pages)
    send_header(KIND_PAYLOAD, PayloadHeader.of(payload).to_ints(), dst, group, "KV payload")
    send_pages(staged, checksums, dst, group, "KV payload")


def recv_payload(src: int, group: dist.ProcessGroup | None = None, *,
                 cache: PagedKVCache | None = None) -> KVTransferPayload:
    """Receive a payload sent by `send_payload` from rank ``src``; its pages land on the host.

    With ``cache``, a payload that could not be imported there now (geometry, page count, free
    blocks) is refused before its pages are sent. Every refusal raises `TransferError` here and
    in the sender."""
    where = f"KV payload from rank {src}"

    def accept(values: list[int]):
        header = PayloadHeader.parse(values, where)
        if cache is not None:
            header.check_fits(cache, where)
        return header, header.buffers(comm_device(group), where)

    header, buffers = recv_header(KIND_PAYLOAD, src, group, accept)
    return KVTransferPayload(header.fingerprint, header.num_tokens, recv_pages(buffers, src, group, where))
