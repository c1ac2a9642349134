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
