"""Send a request's KV pages (`kv.transfer.KVTransferPayload`) from one rank to another.

Disaggregated serving prefills on a context GPU and decodes on a generation GPU; the payload
carries every pool's slots of the request, so the target layers' K/V, the index-K pages and the
shared draft layer travel together. The wire format is tensors only (no pickles): an int64
header (fingerprint length, token count, pool count, each pool's shape), the fingerprint as
UTF-8 bytes, then each pool's uint8 pages. Tensors go through ``comm_device`` so the same calls
work over gloo (CPU) and NCCL (GPU).
"""
from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from m3_eagle_plugin.kv.transfer import KVTransferPayload
from m3_eagle_plugin.parallel.process_group import comm_device

__all__ = ["send_payload", "recv_payload", "send_ints", "recv_ints", "check_sendable", "as_ints"]

_HEADER_FIXED = 3  # fingerprint bytes, num_tokens, num_pools


def send_ints(values: list[int], dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send a list of ints (length first) to rank ``dst``."""
    values = as_ints(values)
    device = comm_device(group)
    dist.send(torch.tensor([len(values)], dtype=torch.int64, device=device), dst, group=group)
    if values:
        dist.send(torch.tensor(values, dtype=torch.int64, device=device), dst, group=group)


def as_ints(values) -> list[int]:
    """``values`` as Python ints; a float raises TypeError (an int64 tensor would truncate it silently)."""
    return [operator.index(v) for v in values]


def recv_ints(src: int, group: dist.ProcessGroup | None = None) -> list[int]:
    """Receive what `send_ints` sent from rank ``src``."""
    device = comm_device(group)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src, group=group)
    n = int(length.item())
    if n < 0:
        raise ValueError(f"peer {src} announced a negative list length {n}")
    if n == 0:
        return []
    values = torch.zeros(n, dtype=torch.int64, device=device)
    dist.recv(values, src, group=group)
    return values.cpu().tolist()


def check_sendable(payload: KVTransferPayload) -> None:
    """Refuse, before the first message, what `recv_payload` would refuse or misread: once the
    header is out, a refusal on either side leaves the rest of the payload stranded in flight.
    A non-int token count would be truncated by the int64 header without a word."""
    if not isinstance(payload, KVTransferPayload):
        raise TypeError(f"payload must be a KVTransferPayload, got {type(payload).__name__}")
    if not isinstance(payload.fingerprint, str):
        raise TypeError(f"payload fingerprint must be a str, got {type(payload.fingerprint).__name__}")
    if not payload.fingerprint:
        raise ValueError("payload has an empty geometry fingerprint")
    if isinstance(payload.num_tokens, bool) or not isinstance(payload.num_tokens, int):
        raise TypeError(f"payload num_tokens must be an int, got {payload.num_tokens!r}")
    if payload.num_tokens < 0:
        raise ValueError(f"payload num_tokens must be >= 0, got {payload.num_tokens}")
    for pages in payload.pool_pages:
        if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 3:
            raise ValueError(f"payload pages must be uint8 [pages, sub_pages, page_bytes] tensors, got "
                             f"{getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}")


def send_payload(payload: KVTransferPayload, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``payload`` to rank ``dst`` (blocking until it is handed to the transport)."""
    check_sendable(payload)
    fingerprint = torch.frombuffer(bytearray(payload.fingerprint.encode("utf-8")), dtype=torch.uint8)
    header = [fingerprint.numel(), payload.num_tokens, len(payload.pool_pages)]
    for pages in payload.pool_pages:
        header.extend(int(x) for x in pages.shape)
    device = comm_device(group)
    send_ints(header, dst, group)
    dist.send(fingerprint.to(device), dst, group=group)
    for pages in payload.pool_pages:
        if pages.numel():
            dist.send(pages.contiguous().to(device), dst, group=group)


def recv_payload(src: int, group: dist.ProcessGroup | None = None) -> KVTransferPayload:
    """Receive a payload sent by `send_payload` from rank ``src``; its pages land on the host."""
    device = comm_device(group)
    header = recv_ints(src, group)
    if len(header) < _HEADER_FIXED:
        raise ValueError(f"KV payload header from rank {src} is too short: {header}")
    fp_len, num_tokens, num_pools = header[:_HEADER_FIXED]
    if fp_len < 1 or num_tokens < 0 or num_pools < 0:
        raise ValueError(f"KV payload header from rank {src} is malformed: {header[:_HEADER_FIXED]}")
    shapes = header[_HEADER_FIXED:]
    if len(shapes) != 3 * num_pools:
        raise ValueError(f"KV payload header from rank {src} announces {num_pools} pools but carries "
                         f"{len(shapes)} shape entries")
    fingerprint = torch.zeros(fp_len, dtype=torch.uint8, device=device)
    dist.recv(fingerprint, src, group=group)
    pool_pages = []
    for i in range(num_pools):
        pages = torch.zeros(tuple(shapes[3 * i: 3 * i + 3]), dtype=torch.uint8, device=device)
        if pages.numel():
            dist.recv(pages, src, group=group)
        pool_pages.append(pages.cpu())
    text = bytes(fingerprint.cpu().tolist()).decode("utf-8")
    return KVTransferPayload(text, int(num_tokens), tuple(pool_pages))
