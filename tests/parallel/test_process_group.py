"""Starting the local group, and the whole two-rank suite over NCCL on two GPUs (skipped without)."""
import os
from pathlib import Path

import pytest
import torch

from m3_eagle_plugin.parallel.process_group import init_local_group


def test_bad_arguments_are_refused_before_any_rendezvous():
    with pytest.raises(ValueError, match="outside"):
        init_local_group(2, 2, 12345)
    with pytest.raises(ValueError, match="backend"):
        init_local_group(0, 2, 12345, backend="mpi")


def test_nccl_without_a_gpu_per_rank_is_refused_naming_the_cause(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(ValueError, match="CUDA devices are visible"):
        init_local_group(0, torch.cuda.device_count() + 1, 12345, backend="nccl")
    assert "NCCL_NVLS_ENABLE" not in os.environ  # refused before touching anything


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_rank_checks_hold_over_nccl(tiny_pair, tmp_path):
    """The gloo checks' core claims with NCCL on cuda:0 / cuda:1 (NCCL_NVLS_ENABLE=0 by default)."""
    from ._spawn import run_ranks
    from ._workers import all_workers

    run_ranks(all_workers, 2, str(tiny_pair[0]), str(tiny_pair[1]), str(tmp_path), timeout_s=400, backend="nccl")
    tp1 = torch.load(Path(tmp_path) / "tp1_loop.pt")
    tp2 = torch.load(Path(tmp_path) / "tp2_rank0.pt")
    assert tp2["tokens"] == tp1["tokens"]
    assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(tp2["logits"], tp1["logits"]))
    rank1 = torch.load(Path(tmp_path) / "rank1.pt")
    assert rank1["outputs"] == rank1["aggregated_outputs"] and rank1["stats"] == rank1["aggregated_stats"]
    assert rank1["replay_stats"] == torch.load(Path(tmp_path) / "rank0.pt")["replay_stats"]


def _fake_cuda(monkeypatch, devices):
    """``devices`` visible GPUs and a rendezvous that only records its arguments (no process group)."""
    import torch.distributed as dist

    calls = {}
    monkeypatch.setattr(os, "environ", {})  # the environment init_local_group sees (and sets)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("device", device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    return calls


def test_the_default_backend_is_nccl_with_a_gpu_per_rank_and_gloo_otherwise(monkeypatch):
    """The docstring's rule: NCCL when every rank has its own GPU (rank r on cuda:r, NVLS off unless
    the caller set it), else gloo (on the loopback interface)."""
    calls = _fake_cuda(monkeypatch, 2)
    assert init_local_group(1, 2, 12345, timeout_s=7.0) == "nccl"
    assert calls["backend"] == "nccl" and calls["device"] == 1
    assert (calls["init_method"], calls["rank"], calls["world_size"]) == ("tcp://127.0.0.1:12345", 1, 2)
    assert calls["timeout"].total_seconds() == 7.0
    assert os.environ == {"NCCL_NVLS_ENABLE": "0"}
    calls = _fake_cuda(monkeypatch, 2)
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    init_local_group(0, 2, 12345)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1" and calls["device"] == 0
    for devices in (0, 1):
        calls = _fake_cuda(monkeypatch, devices)
        assert init_local_group(0, 2, 12345) == "gloo"
        assert calls["backend"] == "gloo" and "device" not in calls
        assert os.environ == {"GLOO_SOCKET_IFNAME": "lo"}


def test_nccl_tensors_live_on_this_ranks_gpu(monkeypatch):
    import torch.distributed as dist

    from m3_eagle_plugin.parallel.process_group import comm_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        assert comm_device() == device


@pytest.mark.parametrize("interfaces, pinned", [
    ([(1, "lo0"), (4, "en0")], {"GLOO_SOCKET_IFNAME": "lo0"}),  # macOS and the BSDs: gloo refuses "lo" there
    ([(2, "eth0")], {}),  # no loopback by a name we know: gloo's own choice, not a name it refuses
    ([(1, "lo"), (2, "eth0")], {"GLOO_SOCKET_IFNAME": "lo"}),
])
def test_gloo_is_pinned_to_a_loopback_interface_this_host_has(monkeypatch, interfaces, pinned):
    """Gloo fails every rendezvous on an interface name the host lacks ("Unable to find address for:
    lo"): the default is the host's own loopback name, and none where it has no usual one."""
    import socket

    calls = _fake_cuda(monkeypatch, 0)
    monkeypatch.setattr(socket, "if_nameindex", lambda: interfaces)
    assert init_local_group(0, 2, 12345) == "gloo" and calls["backend"] == "gloo"
    assert os.environ == pinned


def test_a_gloo_interface_the_caller_chose_is_kept(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    init_local_group(0, 2, 12345)
    assert os.environ == {"GLOO_SOCKET_IFNAME": "eth0"}


@pytest.mark.parametrize("args, kwargs, cause", [
    ((0, 2, 12345), {"timeout_s": 0}, "timeout_s must be a finite number of seconds >= 0.001 and <= 1e9, got 0"),
    ((0, 2, 12345), {"timeout_s": 1e10}, "timeout_s must be"),
    ((0, 2, 12345), {"timeout_s": 1e-9}, "timeout_s must be"),
    ((0, 2, 12345), {"timeout_s": float("nan")}, "timeout_s must be"),
    ((0, 2, 12345), {"timeout_s": float("inf")}, "timeout_s must be"),
    ((True, 2, 12345), {}, "rank must be an int, got bool"),
    ((0, 2.0, 12345), {}, "world_size must be an int"),
    ((0, 2, 12345.5), {}, "port must be an int"),
    ((0, 2, 0), {}, r"port must be in \[1, 65535\], got 0"),
])
def test_a_bad_timeout_rank_or_port_is_refused_by_name_before_any_rendezvous(monkeypatch, args, kwargs, cause):
    """A timeout under torch's millisecond failed as "the client socket has timed out after 0ms"
    (a network fault, to the reader), NaN as a float conversion; a bool rank ran as rank 1 and a
    fractional port was truncated to another port."""
    calls = _fake_cuda(monkeypatch, 0)
    with pytest.raises((TypeError, ValueError), match=cause):
        init_local_group(*args, **kwargs)
    assert calls == {} and os.environ == {}  # no rendezvous, the environment untouched


def test_the_longest_timeout_taken_still_waits(monkeypatch):
    """torch's deadlines are int64 nanoseconds: a timeout past about 9.2e9 s (1e10 s, meant as "no timeout")
    wrapped and the rendezvous failed at once as "the client socket has timed out". The longest one taken,
    1e9 s, joins a one-rank group over loopback."""
    import socket

    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so the loopback name set below is undone
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert init_local_group(0, 1, port, backend="gloo", timeout_s=1e9) == "gloo"
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
