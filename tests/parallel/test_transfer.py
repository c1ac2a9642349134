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


def test_page_checksums_that_would_not_fit_their_frame_are_refused_by_both_ends_up_front():
    """The CRC-32 of every page of every pool travels in one frame after the pages: past
    `MAX_FRAME_INTS` of them the sender failed only once every page was out (its receiver left
    waiting for the checksums). Two pools of byte-less pages: one checksum per page each."""
    from m3_eagle_plugin.parallel.transfer import MAX_FRAME_INTS, PayloadHeader, TransferError, check_sendable

    half = MAX_FRAME_INTS // 2

    def pools(pages):
        return tuple(torch.zeros(pages, 1, 0, dtype=torch.uint8) for _ in range(2))

    check_sendable(KVTransferPayload("fp", 0, pools(half)))  # exactly the limit travels
    with pytest.raises(ValueError, match=f"{MAX_FRAME_INTS + 2} pages .* more page checksums than one frame"):
        check_sendable(KVTransferPayload("fp", 0, pools(half + 1)))
    with pytest.raises(TransferError, match="more page checksums than one frame"):
        PayloadHeader.parse(_header(shapes=((half + 1, 1, 0), (half + 1, 1, 0))), "here")
    PayloadHeader.parse(_header(shapes=((half, 1, 0), (half, 1, 0))), "here")


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


def test_pages_of_another_dtype_are_refused_naming_the_dtype_and_the_pool_sizes_that_differ():
    """The pool geometry is one nested field: cut whole to 120 characters, a float32 and a bfloat16
    cache's geometries read alike as far as they were shown ("geometry (payload {"draft_layers": [],
    "placements": ...") and the page sizes that differ were never named."""
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.kv.transfer import cache_fingerprint
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    wide, narrow = (PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=dtype)
                    for dtype in (torch.float32, torch.bfloat16))
    # by hand: 2 KV heads x 4 tokens x head_dim 8 per K or V page, 1 x 4 x 4 per index-K page
    assert [[p.page_bytes, p.sub_pages] for p in wide.geometry.pools] == [[256, 4], [64, 1]]
    assert [[p.page_bytes, p.sub_pages] for p in narrow.geometry.pools] == [[128, 4], [32, 1]]
    shapes = tuple((0, p.sub_pages, p.page_bytes) for p in narrow.geometry.pools)
    with pytest.raises(TransferError) as info:
        PayloadHeader(cache_fingerprint(wide), 0, shapes).check_fits(narrow, "here")
    assert str(info.value) == ('here: the KV geometry differs from this cache\'s in dtype (payload "torch.float32", '
                               'cache "torch.bfloat16"); geometry.pools (payload [[256, 4], [64, 1]], '
                               'cache [[128, 4], [32, 1]])')


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


def test_a_fingerprint_nested_past_the_json_parsers_depth_is_refused_as_not_a_fingerprint():
    """A fingerprint of the allowed size can nest arrays deeper than `json.loads` goes: its
    RecursionError escaped the comparison, so the receiver raised it instead of a TransferError,
    and the sender was told only 'maximum recursion depth exceeded'."""
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.parallel.transfer import MAX_FINGERPRINT_BYTES, PayloadHeader, TransferError

    cache = PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=torch.float32)
    nested = "[" * 5000
    assert len(nested) <= MAX_FINGERPRINT_BYTES
    shapes = tuple((0, p.sub_pages, p.page_bytes) for p in cache.geometry.pools)
    with pytest.raises(TransferError, match=r"its form: '\[\[\[.* is not a cache fingerprint"):
        PayloadHeader(nested, 0, shapes).check_fits(cache, "here")


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


def test_a_header_needing_more_blocks_than_are_free_is_refused_as_the_import_would_refuse_it():
    """`recv_payload(cache=)` refuses what could not be imported there before the pages cross:
    `import_request` (the oracle) refuses a payload needing more blocks than are free now."""
    from m3_eagle_plugin.kv import PagedKVCache
    from m3_eagle_plugin.kv.allocator import OutOfBlocksError
    from m3_eagle_plugin.kv.transfer import export_request, import_request
    from m3_eagle_plugin.parallel.transfer import PayloadHeader, TransferError

    def cache():
        return PagedKVCache.for_minimax_m3(2, [1], 2, 8, 4, 4, 8, dtype=torch.float32)  # 8 blocks of 4

    source = cache()
    source.add_request(0)
    source.reserve(0, 8)
    payload = export_request(source, 0)  # 2 pages
    busy = cache()
    busy.add_request(5)
    busy.reserve(5, 28)  # 7 of the 8 blocks held
    with pytest.raises(OutOfBlocksError):
        import_request(busy, 0, payload)
    with pytest.raises(TransferError, match="2 pages, 1 of this cache's 8 are free"):
        PayloadHeader.of(payload).check_fits(busy, "here")
    busy.reserve(5, 24)
    busy.rewind(5, 24)  # one more block free: both take it
    PayloadHeader.of(payload).check_fits(busy, "here")
    import_request(busy, 0, payload)


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
    with pytest.raises(t.TransferError, match="sending the list of ints was cut off part-way"):
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


# The frame layout as the module docstring writes it (wire format version 3), spelled out here.
DOC_MAGIC, DOC_VERSION = int.from_bytes(b"M3EAGLE", "big"), 3


def _recording_wire(monkeypatch, recvs):
    """`_one_sided_wire` whose sends are recorded (as int lists) instead of dropped."""
    sent = []
    _one_sided_wire(monkeypatch, [], recvs)
    from m3_eagle_plugin.parallel import transfer as t

    monkeypatch.setattr(t.dist, "send", lambda tensor, dst, group=None: sent.append(tensor.tolist()))
    return sent


def test_an_int_frame_is_sent_in_the_documented_layout(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    sent = _recording_wire(monkeypatch, [])
    t.send_ints([7, -3, 0], 1, _Group())
    assert sent == [[DOC_MAGIC, DOC_VERSION, 1, 3], [7, -3, 0, -DOC_MAGIC]]


def test_a_value_past_int64_is_refused_before_any_message_and_the_stream_stays_usable(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    sent, group = _recording_wire(monkeypatch, []), _Group()
    for big in (1 << 63, -(1 << 63) - 1):
        with pytest.raises(t.TransferError, match="not an int64"):
            t.send_ints([1, big], 1, group)
    assert sent == []
    t.send_ints([(1 << 63) - 1], 1, group)  # the largest int64 travels
    assert sent == [[DOC_MAGIC, DOC_VERSION, 1, 1], [(1 << 63) - 1, -DOC_MAGIC]]


def test_a_header_refused_by_an_exception_without_a_message_is_still_refused(monkeypatch):
    """An empty verdict means "accepted" on the wire: a refusal must never send one, even when the
    exception that refused says nothing (its type is the reason then)."""
    from m3_eagle_plugin.parallel import transfer as t

    body = _header()
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 2, len(body)]), torch.tensor(body + [-DOC_MAGIC])])

    def accept(values):
        raise MemoryError

    with pytest.raises(MemoryError):
        t.recv_header(2, 0, _Group(), accept)
    (magic, version, kind, n), reason = sent
    assert (magic, version, kind) == (DOC_MAGIC, DOC_VERSION, 4) and n > 0
    assert bytes(reason[:-1]).decode() == "MemoryError" and reason[-1] == -DOC_MAGIC


def _out_of_sync(t, peer, group):
    """Whether the next message with ``peer`` is refused as out of sync (nothing is sent or read)."""
    try:
        t.send_ints([0], peer, group)
    except t.TransferError as error:
        return "out of sync" in str(error)
    return False


def test_a_frame_announcing_more_ints_than_the_limit_is_refused_before_its_body_is_read(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 1, (1 << 24) + 1])])  # no body follows
    with pytest.raises(t.TransferError, match=f"announced a frame of {(1 << 24) + 1} ints"):
        t.recv_ints(0, group)
    assert _out_of_sync(t, 0, group) and sent == []


def test_a_frame_of_exactly_the_limit_is_sent(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    shapes = []
    _one_sided_wire(monkeypatch, [], [])
    monkeypatch.setattr(t.dist, "send", lambda tensor, dst, group=None: shapes.append(tensor.shape[0]))
    values = [0] * (1 << 24)  # straight to the framing (`send_ints` would check 16 M ints one by one)
    t._send_frame(t.KIND_INTS, values, 1, _Group())
    assert shapes == [4, (1 << 24) + 1]
    with pytest.raises(t.TransferError, match="over the 16777216 limit"):
        t._send_frame(t.KIND_INTS, values + [0], 1, _Group())


def test_a_send_that_fails_on_the_wire_puts_the_stream_out_of_sync(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    _one_sided_wire(monkeypatch, [None, RuntimeError("connection reset")], [])
    with pytest.raises(t.TransferError, match="sending a list of ints to rank 1 failed: connection reset"):
        t.send_ints([1, 2], 1, group)
    assert _out_of_sync(t, 1, group)


def test_an_int_list_where_a_header_belongs_is_refused_without_an_answer(monkeypatch):
    """The int list's sender waits for no verdict: answering it would put a frame in the stream that
    nobody reads. The stream is out of sync from then on."""
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 1, 2]), torch.tensor([5, 6, -DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="expected a KV payload header from rank 0, got a list of ints"):
        t.recv_header(2, 0, group, lambda values: pytest.fail("accepted an int list as a header"))
    assert sent == [] and _out_of_sync(t, 0, group)


def test_an_answer_that_is_not_a_verdict_puts_the_stream_out_of_sync(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 1, 1]), torch.tensor([0, -DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="no verdict on the KV payload: expected a verdict from rank 1, "
                                              "got a list of ints"):
        t.send_header(2, _header(), 1, group, "KV payload")
    assert len(sent) == 2 and _out_of_sync(t, 1, group)


def test_a_framing_abort_answering_a_header_raises_its_cause_and_puts_the_stream_out_of_sync(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    cause = list(b"the body arrived short")
    _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 6, len(cause)]), torch.tensor(cause + [-DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="rank 1 lost the framing of the KV payload: the body arrived short"):
        t.send_header(2, _header(), 1, group, "KV payload")
    assert _out_of_sync(t, 1, group)


def test_a_frame_after_the_pages_that_is_not_their_checksums_puts_the_stream_out_of_sync(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    group = _Group()
    pages = torch.arange(8, dtype=torch.uint8).view(1, 2, 4)
    sums = t.page_checksums([pages])
    _recording_wire(monkeypatch, [pages, torch.tensor([DOC_MAGIC, DOC_VERSION, 1, 1]), torch.tensor([sums[0], -DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="after the pages of the KV payload: expected a page checksums "
                                              "from rank 0, got a list of ints"):
        t.recv_pages([torch.zeros(1, 2, 4, dtype=torch.uint8)], 0, group, "KV payload")
    assert _out_of_sync(t, 0, group)


def test_the_receiver_answers_the_pages_with_a_final_verdict(monkeypatch):
    """Wire version 3: after the checksums, an empty verdict when every page arrived whole, the
    damaged page's reason otherwise; the framing is intact either way, so the stream stays in step."""
    from m3_eagle_plugin.parallel import transfer as t

    pages = torch.arange(8, dtype=torch.uint8).view(1, 2, 4)
    (crc,) = t.page_checksums([pages])
    group = _Group()
    sent = _recording_wire(monkeypatch, [pages, torch.tensor([DOC_MAGIC, DOC_VERSION, 5, 1]),
                                         torch.tensor([crc, -DOC_MAGIC])])
    (got,) = t.recv_pages([torch.zeros(1, 2, 4, dtype=torch.uint8)], 0, group, "KV payload")
    assert torch.equal(got, pages) and sent == [[DOC_MAGIC, DOC_VERSION, 4, 0], [-DOC_MAGIC]]

    sent = _recording_wire(monkeypatch, [pages, torch.tensor([DOC_MAGIC, DOC_VERSION, 5, 1]),
                                         torch.tensor([crc ^ 1, -DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="page 0 of pool 0 arrived corrupt") as refused:
        t.recv_pages([torch.zeros(1, 2, 4, dtype=torch.uint8)], 0, group, "KV payload")
    (magic, version, kind, n), reason = sent
    assert (magic, version, kind) == (DOC_MAGIC, DOC_VERSION, 4) and len(reason) == n + 1
    assert bytes(reason[:-1]).decode() == str(refused.value)
    assert not _out_of_sync(t, 0, group)


def test_the_sender_of_pages_hears_the_final_verdict(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    pages = [torch.arange(8, dtype=torch.uint8).view(1, 2, 4)]
    group = _Group()
    _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 4, 0]), torch.tensor([-DOC_MAGIC])])
    t.send_pages(pages, t.page_checksums(pages), 1, group, "KV payload")  # accepted: returns
    reason = list(b"page 0 of pool 0 arrived corrupt")
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 4, len(reason)]),
                                         torch.tensor(reason + [-DOC_MAGIC])])
    with pytest.raises(t.TransferError, match="rank 1 refused the pages of the KV payload: page 0 of pool 0 "
                                              "arrived corrupt"):
        t.send_pages(pages, t.page_checksums(pages), 1, group, "KV payload")
    assert sent[0] == pages[0].tolist() and sent[1][:3] == [DOC_MAGIC, DOC_VERSION, 5]
    assert not _out_of_sync(t, 1, group)


def test_page_checksums_arriving_corrupt_tell_their_waiting_sender_at_once(monkeypatch):
    """The checksums' sender waits for the final verdict: a broken checksum frame is answered with a
    framing abort (frame 6) instead, so it raises now rather than at its group's timeout."""
    from m3_eagle_plugin.parallel import transfer as t

    pages = torch.arange(8, dtype=torch.uint8).view(1, 2, 4)
    group = _Group()
    sent = _recording_wire(monkeypatch, [pages, torch.tensor([DOC_MAGIC, DOC_VERSION, 5, 1]),
                                         torch.tensor([0, DOC_MAGIC])])  # a damaged trailer
    with pytest.raises(t.TransferError, match="arrived truncated or corrupt"):
        t.recv_pages([torch.zeros(1, 2, 4, dtype=torch.uint8)], 0, group, "KV payload")
    assert sent[0][:3] == [DOC_MAGIC, DOC_VERSION, 6] and "truncated or corrupt" in bytes(sent[1][:-1]).decode()
    assert _out_of_sync(t, 0, group)


def assert_unstageable_pages_fail_before_the_header(monkeypatch, module, send) -> None:
    """Copying the pages to the group's device (out of memory, say) fails before the header goes out:
    failing after an accepted header would leave the receiver reading the next frame as pages.
    ``module`` is where ``send`` finds `stage_pages`."""
    def out_of_memory(pool_pages, group):
        raise torch.OutOfMemoryError("no room for the staged pages")

    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 4, 0]), torch.tensor([-DOC_MAGIC])])
    monkeypatch.setattr(module, "stage_pages", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        send(_Group())
    assert sent == []


def test_pages_that_cannot_be_staged_fail_before_the_header(monkeypatch):
    from m3_eagle_plugin.parallel import transfer as t

    payload = KVTransferPayload("fp", 5, (torch.zeros(2, 3, 8, dtype=torch.uint8),))
    assert_unstageable_pages_fail_before_the_header(monkeypatch, t, lambda group: send_payload(payload, 1, group))


def test_a_receiver_cut_off_before_its_verdict_puts_the_stream_out_of_sync(monkeypatch):
    """Ctrl-C while the receiver checks a header (or the pages' checksums) leaves its sender waiting
    for a verdict that never comes: the receiver's next message with it is refused by name (the
    module docstring: an exchange cut off part-way on this side), and nothing was answered."""
    from m3_eagle_plugin.parallel import transfer as t

    def interrupted(*_args):
        raise KeyboardInterrupt

    group = _Group()
    header = _header()
    sent = _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 2, len(header)]),
                                         torch.tensor(header + [-DOC_MAGIC])])
    with pytest.raises(KeyboardInterrupt):
        t.recv_header(t.KIND_PAYLOAD, 0, group, interrupted)
    assert sent == []  # no verdict
    assert _out_of_sync(t, 0, group)

    group = _Group()
    pages = torch.arange(8, dtype=torch.uint8).view(1, 2, 4)
    sent = _recording_wire(monkeypatch, [pages, torch.tensor([DOC_MAGIC, DOC_VERSION, 5, 1]),
                                         torch.tensor([*t.page_checksums([pages]), -DOC_MAGIC])])
    monkeypatch.setattr(t, "_check_checksums", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.recv_pages([torch.zeros(1, 2, 4, dtype=torch.uint8)], 0, group, "KV payload")
    assert sent == []  # no verdict
    assert _out_of_sync(t, 0, group)


def test_a_sender_cut_off_while_waiting_for_its_verdict_puts_the_stream_out_of_sync(monkeypatch):
    """Ctrl-C while a header's sender waits for the verdict: the receiver answers and then waits for
    that header's pages, so whatever this side sends next would be read as them. The stream must be
    refused by name from then on (the module docstring: an exchange cut off part-way on this side);
    a refusal, by contrast, leaves it in step."""
    from m3_eagle_plugin.parallel import transfer as t
    from m3_eagle_plugin.parallel.disagg import HandoffError

    payload = KVTransferPayload('{"block_size":4}', 5, (torch.zeros(2, 3, 8, dtype=torch.uint8),))
    group = _Group()
    sent = _recording_wire(monkeypatch, [KeyboardInterrupt()])
    with pytest.raises(KeyboardInterrupt):
        send_payload(payload, 1, group)
    assert len(sent) == 2 and sent[0][:3] == [DOC_MAGIC, DOC_VERSION, 2]  # the header frame, no page
    assert _out_of_sync(t, 1, group)

    group = _Group()  # a refusal of the sender's own error type: still in step
    reason = list(b"no room")
    _recording_wire(monkeypatch, [torch.tensor([DOC_MAGIC, DOC_VERSION, 4, len(reason)]),
                                  torch.tensor(reason + [-DOC_MAGIC])])
    with pytest.raises(HandoffError, match="rank 1 refused the handoff: no room"):
        t.send_header(t.KIND_HANDOFF, [1, 2], 1, group, "handoff", error=HandoffError)
    assert not _out_of_sync(t, 1, group)


def test_a_message_without_a_process_group_names_the_missing_group():
    """With no group given and none initialised (``dist.group.WORLD`` is None), a receive or an int
    list was refused as "cannot create weak reference to 'NoneType' object" by the stream state."""
    import torch.distributed as dist

    from m3_eagle_plugin.parallel.disagg import recv_handoff
    from m3_eagle_plugin.parallel.transfer import recv_ints, recv_payload, send_ints

    assert not dist.is_initialized()
    for call in (lambda: send_ints([1], 1), lambda: recv_ints(0), lambda: recv_payload(0), lambda: recv_handoff(0)):
        with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
            call()


def test_an_interrupt_while_waiting_for_a_preamble_leaves_the_stream_out_of_sync(monkeypatch):
    """Ctrl-C during the blocking wait for a frame's preamble is raised only once the preamble has
    arrived (gloo's wait is not cut short: measured, the data is in the buffer when it is raised).
    The body is still on the wire, so the next receive must be refused as out of sync; it read the
    body as a preamble and blamed the peer for not speaking the protocol."""
    from m3_eagle_plugin.parallel import transfer as t

    arriving = [torch.tensor([DOC_MAGIC, DOC_VERSION, 1, 2]), torch.tensor([7, 8, -DOC_MAGIC])]

    def recv(tensor, src, group=None):
        tensor.copy_(arriving.pop(0))
        if len(arriving) == 1:  # the preamble landed, then the interrupt
            raise KeyboardInterrupt

    monkeypatch.setattr(t, "comm_device", lambda group: torch.device("cpu"))
    monkeypatch.setattr(t.dist, "recv", recv)
    group = _Group()
    with pytest.raises(KeyboardInterrupt):
        t.recv_ints(0, group)
    with pytest.raises(t.TransferError, match=r"out of sync \(earlier: receiving a frame was cut off part-way "
                                              r"\(KeyboardInterrupt\)\)"):
        t.recv_ints(0, group)
    assert len(arriving) == 1  # the body was not read as a preamble
