"""build_engine refuses what the engine would refuse before it reads any weight."""
from __future__ import annotations

import pytest

import m3_eagle_plugin.models.loader as loader
from m3_eagle_plugin.host.reference import build
from m3_eagle_plugin.host.reference.build import build_engine
from m3_eagle_plugin.host.reference.engine import EngineConfig
from m3_eagle_plugin.host.reference.sampler import SamplingParams


@pytest.mark.parametrize("cause,config,num_blocks", [
    ("num_blocks", EngineConfig(draft_len=2), 0),
    ("num_blocks", EngineConfig(draft_len=2), 2.5),
    ("eos_ids", EngineConfig(draft_len=2, eos_ids=(10**6,)), 64),
    ("force_accepted", EngineConfig(draft_len=2, force_accepted=3), 64),
    ("max_tokens_per_step", EngineConfig(draft_len=3, max_tokens_per_step=2), 64),
    ("cuda-graphs", EngineConfig(draft_len=2, cuda_graphs=True), 64),
    ("greedy benchmark mode", EngineConfig(draft_len=2, force_accepted=1, sampling=SamplingParams(temperature=1.0)),
     64),
])
def test_settings_the_engine_refuses_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch, cause, config,
                                                                           num_blocks):
    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    with pytest.raises(ValueError, match=cause):
        build_engine(*tiny_pair, config, num_blocks=num_blocks, device="cpu")


def test_a_draft_length_no_drafter_uses_is_not_held_against_the_target_only_engine(tiny_pair):
    """Without a head or proposer nothing drafts: draft_len 3 with 2 tokens per step runs target only."""
    engine = build_engine(tiny_pair[0], None, EngineConfig(draft_len=3, max_tokens_per_step=2), num_blocks=16)
    assert engine.k == 0


@pytest.mark.parametrize("with_draft,config,cause", [
    (False, EngineConfig(draft_len=2, cuda_graphs=True), "draft head"),
    (True, EngineConfig(draft_len=0, cuda_graphs=True), "draft head and K >= 1"),
    (True, EngineConfig(draft_len=2, cuda_graphs=True, sampling=SamplingParams(temperature=1.0)), "greedy"),
])
def test_cuda_graphs_the_engine_cannot_capture_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch,
                                                                                   with_draft, config, cause):
    """On a CUDA device the engine's graphs refuse a run without a head (or K = 0) and sampling: so
    must build_engine, before it reads a target that may take minutes to load. Nothing here touches
    a GPU: the memory check is stubbed and the run stops before any weight would be read."""
    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    monkeypatch.setattr(build, "_free_bytes", lambda device: None)
    with pytest.raises(ValueError, match=cause):
        build_engine(tiny_pair[0], tiny_pair[1] if with_draft else None, config, num_blocks=64, device="cuda")


def test_cuda_graphs_with_a_proposer_but_no_head_are_refused_before_any_weight_is_read(tiny_pair, monkeypatch):
    """A proposer drafts K tokens, but the graphs capture the Eagle3 head's step: no head is refused even
    though K >= 1."""
    from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    monkeypatch.setattr(build, "_free_bytes", lambda device: None)
    with pytest.raises(ValueError, match="need a draft head"):
        build_engine(tiny_pair[0], None, EngineConfig(draft_len=2, cuda_graphs=True), num_blocks=64, device="cuda",
                     proposer=PromptLookupProposer())


def test_blocks_for_prompts_gives_each_request_its_own_whole_blocks():
    """Blocks are per request (pages are not shared): prompt + new tokens + 4K + 1 tokens each, rounded
    up to whole blocks of 4, then summed. By hand: 3 + 1 + 0 + 1 = 5 tokens -> 2 blocks, twice -> 4
    (not ceil(10 / 4) = 3); with K = 1: 3 + 1 + 4 + 1 = 9 -> 3 blocks, twice -> 6; no prompts -> 1."""
    assert build.blocks_for_prompts([[1, 2, 3], [4, 5, 6]], 1, 0, 4) == 4
    assert build.blocks_for_prompts([[1, 2, 3], [4, 5, 6]], 1, 1, 4) == 6
    assert build.blocks_for_prompts([], 4, 1, 4) == 1


def test_with_blocks_for_prompts_no_request_waits_for_admission():
    """Its promise, on the fake engine: every prompt is admitted in the first step."""
    from m3_eagle_plugin.host.reference.engine import Engine
    from m3_eagle_plugin.host.reference.request import RequestState

    from . import _fakes

    prompts, new, k = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2]], 1, 0
    target = _fakes.FakeTarget()
    cache = _fakes.make_cache(build.blocks_for_prompts(prompts, new, k, _fakes.BLOCK))
    engine = Engine(target, cache, EngineConfig(draft_len=k, max_batch_size=8, max_tokens_per_step=64),
                    vocab_size=_fakes.VOCAB)
    schedule, first = engine.scheduler.schedule, []

    def recorded(requests):
        rows = schedule(requests)
        if not first:
            first.append([r.state for r in requests])
        return rows

    engine.scheduler.schedule = recorded
    result = engine.generate(prompts, max_new_tokens=new)
    assert result.outputs == [target.greedy(p, new) for p in prompts]
    assert RequestState.WAITING not in first[0]


def test_a_cache_that_fills_free_memory_exactly_is_refused_for_the_step_buffers(monkeypatch):
    """The cache itself fits (equal to the free bytes); the step buffers beside it do not: the message
    names them, not the cache."""
    import torch

    monkeypatch.setattr(build, "_free_bytes", lambda device: 1000)
    build._check_memory_fits(900, 100, 4, EngineConfig(), torch.device("cpu"))  # exactly fits
    with pytest.raises(ValueError, match="the step buffers"):
        build._check_memory_fits(1000, 1, 4, EngineConfig(), torch.device("cpu"))
    with pytest.raises(ValueError, match="^a KV cache of 4 blocks needs"):  # the step-buffer message names it too
        build._check_memory_fits(1001, 0, 4, EngineConfig(), torch.device("cpu"))


def test_a_draft_head_of_another_head_dim_is_refused_naming_the_field_before_any_weight_is_read(tiny_pair, tmp_path,
                                                                                               monkeypatch):
    """The draft layer lives in the target's K/V pages: a head exported for a target with 32-wide heads
    (the tiny draft has 16) is refused by its head_dim, not by a page size the user never set."""
    import json
    import shutil

    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the draft was checked")

    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    raw = json.loads((target / "config.json").read_text())
    raw["text_config"]["head_dim"] = 32
    (target / "config.json").write_text(json.dumps(raw))
    monkeypatch.setattr(loader, "load_target", read_weights)
    with pytest.raises(ValueError, match=r"draft/config\.json: head_dim: the draft head's 16 differs from the "
                                         r"target's 32"):
        build_engine(target, tiny_pair[1], EngineConfig(draft_len=2), num_blocks=16, device="cpu")


# ---- adversarial review: the memory check inside a container ----

def _fake_cgroups(monkeypatch, tmp_path, own: str, levels: dict) -> None:
    """A v2 and a v1 mount under tmp_path; `levels` maps (version, relative dir) to its files' text."""
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    for (version, where), files in levels.items():
        level = (v2 if version == 2 else v1) / where
        level.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (level / name).write_text(text)
    (tmp_path / "cgroup").write_text(own)
    monkeypatch.setattr(build, "CGROUP_MOUNTS", (
        (v2, "memory.max", "memory.current", "inactive_file"),
        (v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")))
    monkeypatch.setattr(build, "PROC_CGROUP", tmp_path / "cgroup")


def test_a_containers_memory_limit_below_the_hosts_free_memory_is_the_one_checked_and_named(tmp_path, monkeypatch):
    """A 4 GiB cgroup v2 limit with 1.5 GiB in use, 0.5 of it inactive file cache (reclaimable), on a host
    with 128 GiB free: 4 - 1.5 + 0.5 = 3 GiB are free, by hand. /proc/meminfo alone passed an 8 GiB cache,
    and the kernel's OOM killer ended the run instead of a message."""
    import torch

    GiB = 2**30
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {(2, "."): {
        "memory.max": f"{4 * GiB}\n", "memory.current": f"{3 * GiB // 2}\n",
        "memory.stat": f"anon {GiB}\nactive_file 0\ninactive_file {GiB // 2}\n"}})
    monkeypatch.setattr(build, "_free_bytes", lambda device: 128 * GiB)
    cpu = torch.device("cpu")
    build._check_memory_fits(3 * GiB - 100, 100, 4, EngineConfig(), cpu)  # exactly the 3 GiB
    with pytest.raises(ValueError) as info:
        build._check_memory_fits(8 * GiB, 0, 4, EngineConfig(), cpu)
    assert str(info.value) == (
        f"a KV cache of 4 blocks needs 8.00 GiB but cpu under the cgroup memory limit {tmp_path / 'v2/memory.max'} "
        f"(4.00 GiB, 1.50 GiB in use, 0.50 GiB of it reclaimable cache) has 3.00 GiB free: lower --kv-blocks (or "
        f"the prompts, --max-new-tokens)")
    with pytest.raises(ValueError, match=r"the step buffers .* but cpu under the cgroup memory limit"):
        build._check_memory_fits(3 * GiB - 100, 101, 4, EngineConfig(), cpu)
    build._check_memory_fits(8 * GiB, 0, 4, EngineConfig(), torch.device("cuda"))  # a GPU's is not the cgroup's


def test_the_tightest_cgroup_level_of_this_process_counts_and_no_limit_or_unreadable_files_do_not(tmp_path,
                                                                                                   monkeypatch):
    """v1 without a cgroup namespace: /proc/self/cgroup names /docker/abc under the memory mount; its
    parent /docker holds 2 GiB with 1 in use (1 GiB free), the process's own level 6 GiB with 2 in use,
    the root v1's 'unlimited' (LLONG_MAX rounded to pages). v2's root says "max": no limit. An unreadable
    limit (a directory) or usage (missing, garbage) is no limit either."""
    GiB = 2**30
    own = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    levels = {
        (2, "."): {"memory.max": "max\n", "memory.current": f"{GiB}\n"},
        (1, "."): {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": f"{3 * GiB}\n"},
        (1, "docker"): {"memory.limit_in_bytes": f"{2 * GiB}\n", "memory.usage_in_bytes": f"{GiB}\n",
                        "memory.stat": "inactive_file 5\ntotal_inactive_file 0\n"},
        (1, "docker/abc"): {"memory.limit_in_bytes": f"{6 * GiB}\n", "memory.usage_in_bytes": f"{2 * GiB}\n"},
    }
    _fake_cgroups(monkeypatch, tmp_path, own, levels)
    free, what = build._cgroup_free_bytes()
    assert free == GiB and str(tmp_path / "v1/docker/memory.limit_in_bytes") in what

    (tmp_path / "v1/docker/memory.usage_in_bytes").write_text("garbage\n")
    assert build._cgroup_free_bytes()[0] == 4 * GiB  # the process's own level now
    (tmp_path / "v1/docker/abc/memory.usage_in_bytes").unlink()
    assert build._cgroup_free_bytes()[0] == 9223372036854771712 - 3 * GiB  # the root's 'unlimited'
    (tmp_path / "v1/memory.limit_in_bytes").unlink()
    (tmp_path / "v1/memory.limit_in_bytes").mkdir()
    assert build._cgroup_free_bytes() is None  # v2 "max", every v1 level unreadable
    (tmp_path / "cgroup").unlink()  # no /proc/self/cgroup: the mounts' roots alone
    (tmp_path / "v2/memory.max").write_text(f"{2 * GiB}\n")
    assert build._cgroup_free_bytes()[0] == GiB


def test_a_block_too_large_for_free_memory_names_the_block_size_not_the_block_count(monkeypatch):
    """A cache of blocks of 2**29 tokens whose one block does not fit cannot shrink: --kv-blocks was named,
    though no count fits."""
    import torch

    monkeypatch.setattr(build, "_free_bytes", lambda device: 1000)
    monkeypatch.setattr(build, "_cgroup_free_bytes", lambda: None)
    with pytest.raises(ValueError) as info:
        build._check_memory_fits(2**32, 0, 2, EngineConfig(), torch.device("cpu"), 2**29)
    assert str(info.value) == ("one KV block of 536870912 tokens needs 2.00 GiB (4 bytes a token: the checkpoint's "
                               "block size and attention geometry) but cpu has 0.00 GiB free: no --kv-blocks fits")
    with pytest.raises(ValueError, match=r"^a KV cache of 2 blocks needs"):  # one block fits: the count is the cause
        build._check_memory_fits(2000, 0, 2, EngineConfig(), torch.device("cpu"), 2**29)


def test_the_memory_check_counts_the_weights_loaded_before_the_cache(tiny_pair, monkeypatch):
    """The weights are loaded before the cache is allocated: free memory that holds the cache alone but
    not beside the weights is refused before any weight is read (it passed, and the cache's allocation
    ran out after the load). Oracle: the bytes of a built engine's own parameters, d2t and cache pools."""
    engine = build_engine(*tiny_pair, EngineConfig(draft_len=2), num_blocks=16)
    storages = {}
    for tensor in [*engine.target.parameters(), *engine.head.parameters(), *[d for d in (engine.head.d2t,) if d is not None]]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    weights = sum(storages.values())
    cache = sum(pool.untyped_storage().nbytes() for pool in engine.cache._storage)

    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the memory was checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    monkeypatch.setattr(build, "_cgroup_free_bytes", lambda: None)
    monkeypatch.setattr(build, "_free_bytes", lambda device: weights - 1)
    with pytest.raises(ValueError, match="weights need"):
        build_engine(*tiny_pair, EngineConfig(draft_len=2), num_blocks=16)
    monkeypatch.setattr(build, "_free_bytes", lambda device: cache + weights - 1)  # the cache alone fits
    with pytest.raises(ValueError, match=r"^a KV cache of 16 blocks .* beside the weights .*lower --kv-blocks"):
        build_engine(*tiny_pair, EngineConfig(draft_len=2), num_blocks=16)


def _shipping_variant(draft_dir, dst, vocab: str):
    """The tiny draft shipping its own embedding and: ``full``: its own lm_head; ``reduced``: a 16-id
    draft vocabulary (d -> target 2d) with its own lm_head; ``permuted``: no lm_head, the full vocabulary
    in reverse order (the target's rows gathered)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from m3_eagle_plugin.models.tiny import HIDDEN, VOCAB

    shutil.copytree(draft_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    if vocab != "permuted":
        tensors["lm_head.weight"] = torch.randn(16 if vocab == "reduced" else VOCAB, HIDDEN)
    if vocab == "reduced":
        tensors["d2t"] = torch.arange(16)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 16}))
    if vocab == "permuted":
        tensors["d2t"] = VOCAB - 1 - 2 * torch.arange(VOCAB)  # d -> VOCAB-1-d
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("vocab", ["full", "reduced", "permuted"])
@pytest.mark.parametrize("embeddings", ["target", "own"])
def test_the_weight_bytes_checked_are_those_the_engine_holds_whichever_embeddings_it_uses(tiny_pair, tmp_path,
                                                                                          vocab, embeddings):
    """Shipped copies the head does not use are never read, so they are not counted (4.9 GB for M3's head);
    ones it uses, and an lm_head gathered from the target's rows, are. Oracle: the distinct storages of
    the built engine's parameters and d2t."""
    import torch

    draft = _shipping_variant(tiny_pair[1], tmp_path / "draft", vocab)
    engine = build_engine(tiny_pair[0], draft, EngineConfig(draft_len=2), num_blocks=16,
                          draft_embeddings=embeddings)
    held = {}
    for tensor in [*engine.target.parameters(), *engine.head.parameters(), engine.head.d2t]:
        if tensor is not None:
            held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    from m3_eagle_plugin.eagle3.checkpoint import inspect_draft
    from m3_eagle_plugin.models.config import M3Config

    tc = M3Config.from_file(tiny_pair[0])
    assert build._weight_bytes(tc, inspect_draft(draft, tc, embeddings=embeddings), torch.float32) == sum(held.values())
    assert (engine.head.embed_tokens is engine.target.embed_tokens) == (embeddings == "target")


def test_an_unknown_draft_embeddings_choice_is_refused_before_any_weight_is_read(tiny_pair, monkeypatch):
    def read_weights(*args, **kwargs):
        raise AssertionError("weights read before the settings were checked")

    monkeypatch.setattr(loader, "load_target", read_weights)
    for draft in tiny_pair[1], None:
        with pytest.raises(ValueError, match=r"^embeddings must be one of 'target', 'own', got 'shared'$"):
            build_engine(tiny_pair[0], draft, EngineConfig(draft_len=2), num_blocks=16, draft_embeddings="shared")


def test_blocks_for_prompts_stop_the_new_tokens_at_the_position_limit():
    """As the engine stops generation at max_position_embeddings. By hand, limit 10, blocks of 4, K = 1
    (headroom 4 + 1 = 5), 100 new tokens asked: a 3-token prompt gets 7, 3 + 7 + 5 = 15 -> 4 blocks; a 6-token
    one 4, 6 + 4 + 5 = 15 -> 4 blocks; a 10-token one fills the limit and fails before admission: none. With 2
    asked the 6-token one keeps 2: 6 + 2 + 5 = 13 -> 4 blocks. No limit: 3 + 100 + 5 = 108 -> 27 blocks."""
    assert build.blocks_for_prompts([[1, 2, 3], [1] * 6, [1] * 10], 100, 1, 4, max_positions=10) == 8
    assert build.blocks_for_prompts([[1] * 6], 2, 1, 4, max_positions=10) == 4
    assert build.blocks_for_prompts([[1] * 10], 100, 1, 4, max_positions=10) == 1  # at least one block
    assert build.blocks_for_prompts([[1, 2, 3]], 100, 1, 4) == 27
