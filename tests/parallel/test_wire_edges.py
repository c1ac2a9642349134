"""Wire paths where one side used to wait for a message the other never sends, or read the next
frame as pages (`_workers.wire_edges_worker`): each must raise on both sides, naming the cause,
and the good payload sent next must arrive intact."""
import pytest


@pytest.fixture(scope="module")
def edges(tiny_pair, tmp_path_factory):
    from ._spawn import ranks_evidence
    from ._workers import wire_edges_worker

    return ranks_evidence(wire_edges_worker, tiny_pair, tmp_path_factory, "edges")


def test_a_header_where_an_int_list_belongs_is_refused_to_its_sender(edges):
    sender, receiver = edges
    assert receiver["header where ints belong"].startswith("TransferError: expected a list of ints from rank 0, got a KV")
    # the sender waits for a verdict: it must get one, not a timeout
    assert sender["header where ints belong"].startswith("TransferError: rank 1 refused the KV payload: expected a")
    assert sender["header where ints belong, then"] == "ok"
    assert receiver["header where ints belong, then"] == receiver["good"]


def test_a_refusal_reason_cut_at_the_limit_still_decodes(edges):
    sender, receiver = edges
    assert receiver["long non-ascii refusal"].startswith("TransferError: KV payload from rank 0: the KV geometry")
    assert sender["long non-ascii refusal"].startswith("TransferError: rank 1 refused the KV payload: KV payload from")
    assert receiver["long non-ascii refusal, then"] == receiver["good"]


def test_a_handoff_the_engine_could_never_admit_is_refused_before_its_pages_move(edges):
    sender, receiver = edges
    assert receiver["handoff that never fits"].startswith("HandoffError: request 0 needs"), receiver
    assert sender["handoff that never fits"].startswith("HandoffError: rank 1 refused the handoff of request 0")
    assert receiver["handoff that never fits, then"] == receiver["good"]


def test_pages_that_cannot_be_sent_fail_before_the_header(edges):
    sender, receiver = edges
    assert sender["pages that cannot be staged"].startswith("NotImplementedError"), sender
    assert sender["pages that cannot be staged, then"] == "ok"
    # the next payload's frame must not be read as the failed one's pages
    assert receiver["pages that cannot be staged"] == receiver["good"]


def test_a_handoff_the_engine_cannot_admit_now_is_refused_as_import_would_refuse_it(edges):
    sender, receiver = edges
    assert receiver["budget held"] == ["decode", "decode"]
    # the same handoff received without the engine (its pages crossed) is what import_handoff refuses
    refusal = receiver["handoff with no budget left now, then"]
    assert refusal == "HandoffError: request 0: no KV budget left on the generation engine", refusal
    assert receiver["handoff with no budget left now"] == refusal
    assert sender["handoff with no budget left now"] == f"HandoffError: rank 1 refused the handoff of request 0: {refusal[14:]}"
    assert sender["handoff with no budget left now, then"] == "ok"
    assert receiver["untouched"] is True
