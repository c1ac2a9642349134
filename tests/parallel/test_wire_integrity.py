"""Bytes damaged on the wire between two gloo ranks (`_workers.integrity_worker`).

A header whose body arrives corrupt must fail its sender at once (it waits for a verdict, and
used to wait for its timeout), and both sides must refuse the stream from then on; a page whose
bytes changed in transit must be refused by the receiver naming its pool and page (it used to be
returned, and imported, without a word), the sender must hear that reason in the final verdict
(wire version 3; version 2's sender returned as if all went well), and the stream must stay in
step for the next payload.
"""
import pytest

GROUP_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def integrity(tiny_pair, tmp_path_factory):
    from ._spawn import ranks_evidence
    from ._workers import integrity_worker

    return ranks_evidence(integrity_worker, tiny_pair, tmp_path_factory, "integrity")


def test_a_header_body_damaged_in_transit_fails_the_sender_at_once_and_both_sides_stop(integrity):
    sender, receiver = integrity
    assert receiver["header body"].startswith("TransferError: the frame of") and "truncated or corrupt" \
        in receiver["header body"], receiver
    assert sender["header body"].startswith("TransferError: rank 1 lost the framing of the KV payload: the frame"), \
        sender
    assert sender["header body seconds"] < GROUP_TIMEOUT_S / 2, sender  # not the group's timeout
    assert sender["header body, then"].startswith("TransferError: the stream with rank 1 is out of sync")
    assert receiver["header body, then"].startswith("TransferError: the stream with rank 0 is out of sync")


def test_a_payload_page_damaged_in_transit_is_refused_naming_pool_and_page(integrity):
    sender, receiver = integrity
    assert receiver["payload page"].startswith("TransferError: the KV payload from rank 0: page 1 of pool 1 "
                                               "arrived corrupt"), receiver
    assert sender["payload page"] == "TransferError: rank 1 refused the pages of the KV payload: " + \
        receiver["payload page"].removeprefix("TransferError: "), sender
    assert receiver["payload page, then"] == receiver["good"]  # the stream stayed in step


def test_a_handoff_page_damaged_in_transit_is_refused_naming_request_pool_and_page(integrity):
    sender, receiver = integrity
    pool = sender["handoff pool"]
    assert receiver["handoff page"].startswith(f"TransferError: the handoff from rank 0, request 1: page 0 of "
                                               f"pool {pool} arrived corrupt"), receiver
    assert sender["handoff page"] == "TransferError: rank 1 refused the pages of the handoff of request 1: " + \
        receiver["handoff page"].removeprefix("TransferError: "), sender
    assert receiver["handoff page, then"] == receiver["good"]
