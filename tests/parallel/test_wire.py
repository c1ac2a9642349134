"""The handoff wire between two gloo ranks when a header is malformed, does not fit the receiver,
or the stream breaks (`_workers.wire_worker`).

A refused header raises on both sides, naming the cause, before any page moves and before the
receiving engine is touched; the good handoff sent next must then arrive intact (a refusal that
left pages in flight would have them read as its header). A stream whose framing is lost is
refused from then on instead of being read.
"""
import json

import pytest


@pytest.fixture(scope="module")
def wire(tiny_pair, tmp_path_factory):
    from ._spawn import run_ranks
    from ._workers import wire_worker

    out = tmp_path_factory.mktemp("wire")
    run_ranks(wire_worker, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(out), timeout_s=180)
    rank0 = json.loads((out / "wire_rank0.json").read_text())
    return {**rank0, **json.loads((out / "wire_rank1.json").read_text())}


from m3_eagle_plugin.parallel.transfer import VERSION

PAYLOAD_CAUSES = {
    "version": f"TransferError: rank 0 speaks transfer protocol version {VERSION + 1}, this side speaks {VERSION}",
    "negative num_tokens": "TransferError: KV payload from rank 0: num_tokens -4 is negative",
    "negative page size": r"TransferError: KV payload from rank 0: pool 0 pages have shape \(\d+, -1, \d+\)",
    "absurd page count": "TransferError: KV payload from rank 0: the pages would take .* bytes",
    "pool count": "TransferError: KV payload from rank 0: .*pools",
    "fingerprint byte": "TransferError: KV payload from rank 0: the fingerprint holds values outside a byte",
    "geometry": r"TransferError: .*differs from this cache's in block_size \(payload 8, cache 4\)",
    "page count": "TransferError: .*do not match this cache's",
    "a handoff where a payload belongs": "TransferError: expected a KV payload header from rank 0, got a handoff header",
}


@pytest.mark.parametrize("name", list(PAYLOAD_CAUSES))
def test_refused_payload_header_names_the_cause_on_both_sides_and_the_next_payload_arrives_intact(wire, name):
    import re

    outcome = wire["outcomes"][f"payload {name}"]
    assert re.match(PAYLOAD_CAUSES[name], outcome), outcome
    reason = outcome.split(": ", 1)[1]
    assert reason in wire["sender"][f"payload {name}"]  # the sender was told why (raw verdict or its raise)
    assert wire["sender"][f"payload {name}"].startswith(("refused: ", "TransferError: rank 1 refused",
                                                         "HandoffError: rank 1 refused"))
    assert wire["followups"][f"payload {name}"] == wire["good"]


HANDOFF_CAUSES = {
    "token count": "HandoffError: handoff from rank 0: the header announces .* tokens",
    "negative output length": "HandoffError: handoff from rank 0: output length -1 is below 0",
    "version": "TransferError: rank 0 speaks transfer protocol version 0",
    "token outside the vocabulary": "HandoffError: request 0: token ids must be ints in",
    "kv_len": "HandoffError: request 0: kv_len",
    "pages past the committed positions": "HandoffError: request 0: kv_len .* transferred tokens",
    "geometry": r"HandoffError: .*request 0: the KV geometry differs from this cache's in block_size",
}


@pytest.mark.parametrize("name", list(HANDOFF_CAUSES))
def test_refused_handoff_leaves_the_engine_clean_and_the_next_handoff_imports(wire, name):
    import re

    outcome = wire["outcomes"][f"handoff {name}"]
    assert re.match(HANDOFF_CAUSES[name], outcome), outcome
    assert outcome.split(": ", 1)[1] in wire["sender"][f"handoff {name}"]
    assert wire["clean"][f"handoff {name}"]
    num_tokens, sums, shapes, imported = wire["followups"][f"handoff {name}"]
    assert [num_tokens, sums, shapes] == wire["good"] and imported == num_tokens


def test_short_or_foreign_frames_put_the_stream_out_of_sync_instead_of_being_read(wire):
    from ._workers import SHORT_FRAME_TIMEOUT

    outcomes = wire["outcomes"]
    assert outcomes["short frame"].startswith("TransferError: the frame of") and "truncated" in outcomes["short frame"]
    # a short header body is caught on arrival, and its sender (waiting for a verdict) is told so:
    # neither side waits for the group's timeout
    assert wire["sender"]["short frame"] == "aborted: " + outcomes["short frame"].split(": ", 1)[1]
    assert wire["seconds"]["short frame"] < SHORT_FRAME_TIMEOUT.total_seconds() / 2, wire["seconds"]
    assert "not speaking the m3-eagle transfer protocol" in outcomes["foreign frame"]
    for after in ("after the short frame", "after the foreign frame"):
        assert outcomes[after].startswith("TransferError: the stream with rank 0 is out of sync"), outcomes[after]


def test_stream_cut_inside_the_pages_raises_and_registers_nothing(wire):
    assert wire["sender"]["cut"] == "accepted"
    assert wire["outcomes"]["cut"].startswith("TransferError: the stream from rank 0 broke while receiving "
                                              "pool 1 of 2"), wire["outcomes"]["cut"]
    assert wire["outcomes"]["after the cut"].startswith("TransferError: the stream with rank 0 is out of sync")
    assert wire["clean"]["cut"]
