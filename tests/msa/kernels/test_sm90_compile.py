"""The verify step's kernels (scoring, top-k, attention) compile for an H100/H200 target on any machine.

Why: CI has no GPU and Triton's interpreter neither compiles nor checks a kernel's layouts, so a
kernel change made on a CPU machine could first fail in a GPU session (a compiler crash, or tiles
past an SM's shared memory). Triton compiles for sm_90 offline (`GPUTarget`, its bundled ptxas):
each case below is the M3 per-rank geometry (GQA group 16, head dim 128, block 128, top-16) in
the variants the dispatchers choose between (splits, self-merge, early launch, two-page tiles,
PDL, fp8 or 16-bit pages, default key tiles), and the shared memory a program asks for must fit
the H200's 232,448 bytes. Which MMA path a tile takes is checked where a measured miscompile depends on it
(`sparse_verify.paired_v_tile_ok`).
"""
from __future__ import annotations

import pytest

from .kernel_case_helpers import compile_for_sm90, sm90_compiler_available

H200_SHARED_BYTES = 232_448

pytestmark = pytest.mark.skipif(not sm90_compiler_available(), reason="needs Triton's compiler")

#: Pointer element types by parameter name; other `*_ptr` parameters are int32, other scalars int32.
BF16_STEP = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "o_ptr": "*bf16", "fin_ptr": "*bf16",
             "lse_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32"}


def _token_constexprs(**over):
    base = dict(G=16, ROWS=16, TOPK=16, TOPK_P=16, BLOCK=128, BN=128, D=128, SPLITS=1, F16=True, PREFETCH=True,
                IEEE=False, VPAIR=True, ASM=True, SELF_MERGE=False, READY=False, PDL=True, REQUEST_MAJOR=True)
    return {**base, **over}


@pytest.mark.parametrize("over,stages", [
    (dict(), 3),                                       # one split, request-major, PDL (the B64 step)
    (dict(SPLITS=4, SELF_MERGE=True), 3),              # small batches: splits merged in-kernel
    (dict(SPLITS=2, READY=True), 3),                   # launched early, polling the top-k's flags
    (dict(SPLITS=2, READY=True, BN=256), 2),           # early, two pages a tile (`verify_step.early_tiling`)
    (dict(VPAIR=False, F16=False, REQUEST_MAJOR=False, PDL=False), 3),   # bf16 queries on bf16 pages
], ids=["one-split", "self-merge", "ready", "two-pages", "bytes"])
def test_per_token_sparse_attention_compiles_within_shared_memory(over, stages):
    from m3_eagle_plugin.msa.kernels.sparse_verify import _sparse_token_kernel

    types = dict(BF16_STEP)
    if over.get("VPAIR") is False:
        types.update(k_ptr="*bf16", v_ptr="*bf16")
    compiled = compile_for_sm90(_sparse_token_kernel, _token_constexprs(**over), types, num_stages=stages)
    assert 0 < compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared
    assert "mma.sync.aligned" in compiled.asm["ptx"]  # a 16-row tile: the warp-level MMA


def test_two_page_tile_rule_matches_the_compiler():
    """`two_page_tile_fits` refuses a bf16 two-page tile (128 KB): at the default three stages it asks
    for more shared memory than an SM has (274,432 bytes on the H200, as measured there), while
    the e4m3 tile it allows fits at every depth."""
    from m3_eagle_plugin.msa.kernels.sparse_verify import _sparse_token_kernel, two_page_tile_fits

    assert two_page_tile_fits(128, 128, 1) and not two_page_tile_fits(128, 128, 2)
    bf16 = dict(BF16_STEP, k_ptr="*bf16", v_ptr="*bf16")
    wide = compile_for_sm90(_sparse_token_kernel, _token_constexprs(BN=256, VPAIR=False, F16=False), bf16)
    assert wide.metadata.shared > H200_SHARED_BYTES, wide.metadata.shared
    fp8 = compile_for_sm90(_sparse_token_kernel, _token_constexprs(BN=256), BF16_STEP, num_stages=3)
    assert fp8.metadata.shared <= H200_SHARED_BYTES, fp8.metadata.shared


def test_union_sparse_attention_compiles_within_shared_memory():
    from m3_eagle_plugin.msa.kernels.sparse_verify import _sparse_verify_kernel

    consts = dict(G=16, QP=4, UMAX=64, NCH=1, BLOCK=128, BN=64, D=128, SPLITS=2, F16=True, IEEE=False, VPAIR=False,
                  ASM=True, PDL=True)
    compiled = compile_for_sm90(_sparse_verify_kernel, consts, BF16_STEP)
    assert 0 < compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared


@pytest.mark.parametrize("kv,key_tile", [("*bf16", 64), ("*fp8e4nv", 32)])   # the default key tiles
def test_dense_attention_compiles_within_shared_memory(kv, key_tile):
    from m3_eagle_plugin.msa.kernels.dense_verify import _dense_verify_kernel

    consts = dict(G=16, QP=4, BLOCK=128, BN=key_tile, D=128, SPLITS=4, IEEE=False)
    compiled = compile_for_sm90(_dense_verify_kernel, consts, {**BF16_STEP, "k_ptr": kv, "v_ptr": kv})
    assert 0 < compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared


@pytest.mark.parametrize("group,dim,mma", [(16, 128, "mma.sync"), (32, 64, "mma.sync"), (64, 64, "wgmma"),
                                           (64, 128, "wgmma")])
def test_which_tiles_take_the_warp_group_mma(group, dim, mma):
    """The paired-V rule keys on tile rows because 64-row tiles at 4 warps take wgmma, where the
    miscompile was measured, and 16/32-row tiles take mma.sync; were Triton to choose otherwise,
    the rule's premise would need re-measuring on a GPU."""
    from m3_eagle_plugin.msa.kernels.sparse_verify import _sparse_token_kernel, paired_v_tile_ok

    consts = _token_constexprs(G=group, ROWS=max(16, group), BN=64, BLOCK=64, D=dim)
    ptx = compile_for_sm90(_sparse_token_kernel, consts, BF16_STEP).asm["ptx"]
    assert ("wgmma.mma_async" in ptx) == (mma == "wgmma"), mma
    assert paired_v_tile_ok(max(16, group), dim, 64) == (mma == "mma.sync" or dim >= 128)


@pytest.mark.parametrize("tma,one_tile", [(True, True), (True, False), (False, False)],
                         ids=["tma-one-tile", "tma", "plain"])
def test_index_scoring_compiles_within_shared_memory(tma, one_tile):
    """The block scoring as `select_blocks_paged` launches it at M3's index geometry (one index
    head, dim 128, block 128, bf16): a page a program through a TMA descriptor at one stage, or
    per-thread copies at two; the hand-off's release and PDL on."""
    from m3_eagle_plugin.msa.kernels.index_select import _block_score_kernel

    types = {"iq_ptr": "*bf16", "ik_ptr": "*bf16", "score_ptr": "*fp32",
             "ik_desc": "tensordesc<bf16[1,128,128]>" if tma else "*bf16"}
    consts = dict(HI=1, QP=4, BLOCK=128, DI=128, BLOCKS_PER_PROG=1 if tma else 4, IEEE=False, TMA=tma, RELEASE=True,
                  PDL=True, ONE_TILE=one_tile)
    compiled = compile_for_sm90(_block_score_kernel, consts, types, num_stages=1 if tma else 2)
    assert compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared


@pytest.mark.parametrize("qp,nbp,announce", [(1, 64, 4), (1, 1024, 0), (4, 256, 0)],
                         ids=["8K-early", "128K", "32K-union"])
def test_top_k_compiles(qp, nbp, announce):
    """The per-token top-k (polling the scoring's hand-off) at 8K, 128K and a union-writing chunk."""
    from m3_eagle_plugin.msa.kernels.index_select import _topk_union_kernel, default_topk_warps

    consts = dict(QP=qp, NCH=1, NBP=nbp, TOPK=16, TOPK_P=16, LOCAL=1, INIT=0, WRITE_UNION=qp > 1, HANDOFF=True,
                  ANNOUNCE=announce, PDL=True)
    compiled = compile_for_sm90(_topk_union_kernel, consts, {"score_ptr": "*fp32"},
                                num_warps=default_topk_warps(qp, nbp))
    assert compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared
