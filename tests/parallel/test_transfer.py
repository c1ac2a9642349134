"""Sending a `kv.transfer` payload between two gloo processes: the bytes arrive unchanged."""
import json
from pathlib import Path

import pytest
import torch

from m3_eagle_plugin.kv.transfer import KVTransferPayload
from m3_eagle_plugin.parallel.transfer import send_payload



def test_payload_round_trips_between_two_ranks(two_rank_run):
    """Property test (hypothesis on rank 0, `_workers.echo_worker`): random pool shapes, zero-page
    payloads, unicode fingerprints are sent to rank 1 and back byte for byte."""
    assert json.loads((Path(two_rank_run) / "echo.json").read_text())["checked"] == 20


def test_send_refuses_what_is_not_a_payload():
    with pytest.raises(TypeError, match="KVTransferPayload"):
        send_payload({"pages": torch.zeros(1)}, 1)
    bad = KVTransferPayload("fp", 4, (torch.zeros(1, 2, 3, dtype=torch.float32),))
    with pytest.raises(ValueError, match="uint8"):
        send_payload(bad, 1)


def test_send_refuses_what_the_receiver_would_refuse_before_sending_anything():
    """No process group exists here: each refusal must come before the first message, so a peer
    is never left with a header it rejects and the rest of the payload in flight."""
    pages = (torch.zeros(1, 2, 3, dtype=torch.uint8),)
    for bad, error, cause in [(KVTransferPayload("fp", -1, pages), ValueError, "num_tokens"),
                              (KVTransferPayload("fp", 2.5, pages), TypeError, "num_tokens"),
                              (KVTransferPayload("fp", True, pages), TypeError, "num_tokens"),
                              (KVTransferPayload("", 4, pages), ValueError, "fingerprint"),
                              (KVTransferPayload(b"fp", 4, pages), TypeError, "fingerprint")]:
        with pytest.raises(error, match=cause):
            send_payload(bad, 1)


def test_send_refuses_a_payload_the_receiver_would_refuse_by_size():
    """Pools with different page counts (a request has one page of each pool per slot) and an
    oversized fingerprint are refused by the receiver; the sender must refuse them first."""
    uneven = KVTransferPayload("fp", 4, (torch.zeros(1, 2, 3, dtype=torch.uint8), torch.zeros(2, 2, 3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="different page counts"):
        send_payload(uneven, 1)
    with pytest.raises(ValueError, match="fingerprint is over"):
        send_payload(KVTransferPayload("x" * (1 << 17), 4, (torch.zeros(1, 2, 3, dtype=torch.uint8),)), 1)


def _header(shapes=((2, 3, 8), (2, 1, 16)), num_tokens=5, fingerprint='{"block_size":4}'):
    """A KV payload header body as `parallel.transfer`'s docstring lays it out."""
    data = list(fingerprint.encode("utf-8"))
    return [num_tokens, len(shapes), *(x for s in shapes for x in s), len(data), *data]


@pytest.mark.parametrize("values, cause", [
    (_header()[:2], "needs at least 3"),
    ([-1] + _header()[1:], "num_tokens -1 is negative"),
    (_header()[:1] + [1 << 20] + _header()[2:], "pools"),
    (_header()[:1] + [3] + _header()[2:], "ends before|announces"),
    (_header(shapes=((2, -3, 8), (2, 1, 16))), r"pool 0 pages have shape \(2, -3, 8\)"),
    (_header(shapes=((2, 3, 8), (3, 1, 16))), "different page counts"),
    (_header(shapes=((1 << 40, 3, 8), (1 << 40, 1, 16))), "bytes"),
    (_header()[:-1], "announces .* but carries"),
    (_header() + [0], "announces .* but carries"),
    (_header()[:-1] + [300], "outside a byte"),
    (_header()[:-2] + [0xC3, 0x28], "not valid UTF-8"),
    (_header()[:8] + [0], "fingerprint length 0"),
])
def test_payload_header_parse_names_what_is_malformed(values, cause):
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    with pytest.raises(TransferError, match=cause):
        PayloadHeader.parse(values, "here")


def test_payload_header_round_trips_and_checks_the_receiving_cache():
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.kv.transfer import export_request
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    def cache(block_size):
        return PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, block_size, 8, dtype=torch.float32)

    source = cache(4)
    source.add_request(0)
    source.reserve(0, 6)
    payload = export_request(source, 0)
    header = PayloadHeader.of(payload)
    assert header.to_ints() == _header([tuple(p.shape) for p in payload.pool_pages], 6, payload.fingerprint)
    assert PayloadHeader.parse(header.to_ints(), "here") == header
    header.check_fits(cache(4), "here")
    with pytest.raises(TransferError, match=r"differs from this cache's in block_size \(payload 4, cache 8\)"):
        header.check_fits(cache(8), "here")
    with pytest.raises(TransferError, match="do not match this cache's"):
        PayloadHeader(header.fingerprint, 9, header.shapes).check_fits(cache(4), "here")


def test_a_fingerprint_with_the_same_fields_written_another_way_is_refused_naming_that():
    """The receiver compares fingerprints as text (as `import_request` does): one that only differs
    in its spacing or key order is refused too, and the reason must say so rather than name nothing."""
    import json

    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.kv.transfer import cache_fingerprint
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    cache = PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=torch.float32)
    spaced = json.dumps(json.loads(cache_fingerprint(cache)), indent=1)
    shapes = tuple((0, p.sub_pages, p.page_bytes) for p in cache.geometry.pools)
    with pytest.raises(TransferError) as info:
        PayloadHeader(spaced, 0, shapes).check_fits(cache, "here")
    assert not str(info.value).endswith(" in "), str(info.value)
    assert "the same fields" in str(info.value), str(info.value)


def test_page_checksums_are_the_crc32_of_every_page_pool_by_pool():
    """Reference: zlib.crc32 of each page's bytes, taken from a plain Python bytes copy."""
    import zlib

    from m3_eagle_plugin.parallel.transfer import page_checksums

    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, 256, (3, 2, 5), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (3, 1, 7), dtype=torch.uint8, generator=gen)
    expected = [zlib.crc32(bytes(p.flatten().tolist())) for pages in (a, b) for p in pages]
    assert page_checksums([a, b]) == expected and len(set(expected)) == 6
    # a non-contiguous view is summed over its logical bytes, page by page
    t = torch.randint(0, 256, (5, 2, 3), dtype=torch.uint8, generator=gen).transpose(0, 2)  # [3, 2, 5]
    assert not t.is_contiguous()
    assert page_checksums([t]) == [zlib.crc32(bytes(p.flatten().tolist())) for p in t]


def test_a_corrupt_page_is_named_by_its_pool_and_page():
    from m3_eagle_plugin.parallel.transfer import TransferError, _check_checksums, page_checksums

    pools = (torch.zeros(3, 1, 4, dtype=torch.uint8), torch.ones(3, 1, 4, dtype=torch.uint8))
    sums = page_checksums(pools)
    _check_checksums(pools, sums, "payload")
    bad = list(sums)
    bad[5] ^= 1  # pool 1 (the second), page 2 (its third)
    with pytest.raises(TransferError, match="page 2 of pool 1 arrived corrupt"):
        _check_checksums(pools, bad, "payload")
    with pytest.raises(TransferError, match="carries 5 page checksums for its 6 pages"):
        _check_checksums(pools, sums[:5], "payload")
    with pytest.raises(TransferError, match="carries 7 page checksums for its 6 pages"):
        _check_checksums(pools, sums + [0], "payload")


@pytest.mark.parametrize("values, cause", [
    (_header()[:8], "ends before"),  # 2 pools: the 6 shape ints, then no fingerprint length
    (_header(shapes=((1 << 39, 1, 3),)), "the pages would take 1649267441664 bytes"),  # 1.5 TiB
    (_header(fingerprint="a" * ((1 << 16) + 1)), "fingerprint length 65537"),
    (_header()[:-1] + [255], "not valid UTF-8"),  # 0xFF is a byte, but never UTF-8
])
def test_payload_header_parse_refuses_sizes_at_the_limits(values, cause):
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    with pytest.raises(TransferError, match=cause):
        PayloadHeader.parse(values, "here")


def test_a_header_using_every_block_of_the_cache_fits():
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.kv.transfer import cache_fingerprint
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    cache = PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=torch.float32)  # 8 blocks of 4
    def header(num_tokens, pages):
        return PayloadHeader(cache_fingerprint(cache), num_tokens,
                             tuple((pages, p.sub_pages, p.page_bytes) for p in cache.geometry.pools))
    header(32, 8).check_fits(cache, "here")  # all 8 blocks
    with pytest.raises(TransferError, match="9 pages, this cache has 8"):
        header(33, 9).check_fits(cache, "here")


def test_a_refusal_reason_is_cut_at_a_character_boundary():
    from m3_eagle_plugin.parallel.transfer import _utf8

    assert _utf8("é" * 3, 5) == list("éé".encode("utf-8"))  # 2-byte chars: 5 bytes hold two
    assert bytes(_utf8("aé€", 5)).decode("utf-8") == "aé"
    assert _utf8("abc", 5) == [97, 98, 99]


def test_more_pools_than_travel_are_refused_before_sending():
    from m3_eagle_plugin.parallel.transfer import MAX_POOLS, check_sendable

    pages = (torch.zeros(0, 1, 1, dtype=torch.uint8),)
    check_sendable(KVTransferPayload("fp", 0, pages * MAX_POOLS))
    with pytest.raises(ValueError, match=f"{MAX_POOLS + 1} pools, at most {MAX_POOLS} travel"):
        check_sendable(KVTransferPayload("fp", 0, pages * (MAX_POOLS + 1)))


class _Group:
    """A stand-in process group: the stream bookkeeping keys on it (weakly); no message leaves."""


def _one_sided_wire(monkeypatch, sends, recvs):
    """`dist.send` / `dist.recv` replaced: each call takes the next of ``sends`` / ``recvs`` (a tensor
    to copy in, or an exception to raise)."""
    from m3_eagle_plugin.parallel import transfer as t

    def step(queue, tensor):
        item = queue.pop(0)
        if isinstance(item, BaseException):
            raise item
        if item is not None:
            tensor.copy_(item)

    monkeypatch.setattr(t, "comm_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(t.dist, "send", lambda tensor, dst, group=None: step(sends, tensor))
    monkeypatch.setattr(t.dist, "recv", lambda tensor, src, group=None: step(recvs, tensor))


def test_an_exchange_cut_off_between_its_messages_leaves_the_stream_out_of_sync(monkeypatch):
    """Ctrl-C after a frame's preamble (or between pools of pages) leaves the peer's position
    unknown: the next message with that peer is refused by name instead of reading the body
    (or the next pool) as a preamble."""
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    preamble = torch.tensor([t.MAGIC, t.VERSION, t.KIND_INTS, 3])
    _one_sided_wire(monkeypatch, [], [preamble, KeyboardInterrupt()])
    with pytest.raises(KeyboardInterrupt):
        t.recv_ints(0, group)
    with pytest.raises(t.TransferError, match=r"out of sync \(earlier: receiving a frame was cut off part-way "
                                              r"\(KeyboardInterrupt\)\)"):
        t.recv_ints(0, group)

    group = _Group()
    pages = [torch.zeros(1, 2, 4, dtype=torch.uint8), torch.ones(1, 2, 4, dtype=torch.uint8)]
    _one_sided_wire(monkeypatch, [None, KeyboardInterrupt()], [])
    with pytest.raises(KeyboardInterrupt):
        t.send_pages(pages, t.page_checksums(pages), 1, group, "KV payload")
    with pytest.raises(t.TransferError, match="sending the pages of the KV payload was cut off part-way"):
        t.send_ints([1, 2], 1, group)

    group = _Group()  # another peer in the same group is not affected
    _one_sided_wire(monkeypatch, [None, KeyboardInterrupt(), None, None], [])
    with pytest.raises(KeyboardInterrupt):
        t.send_ints([1, 2], 1, group)
    t.send_ints([1, 2], 2, group)
    with pytest.raises(t.TransferError, match="sending the int list was cut off part-way"):
        t.send_ints([1, 2], 1, group)


def test_an_int_list_for_the_wire_takes_integers_and_refuses_bool_and_float_by_position():
    """`as_ints` (every int frame goes through it): numpy and 0-d torch integers travel as Python
    ints; a bool is not the 1 it would become, a float not the int it would be cut to."""
    import numpy as np

    from m3_eagle_plugin.parallel.transfer import as_ints

    got = as_ints([3, np.int64(-4), torch.tensor(5)])
    assert got == [3, -4, 5] and all(type(v) is int for v in got)
    for bad, kind in ((True, "bool"), (2.0, "float")):
        with pytest.raises(TypeError, match=rf"ints\[1\] must be an int, got {kind}"):
            as_ints([7, bad])
