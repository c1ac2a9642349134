"""One B64/32K verify step of the sparse kernels, for `ncu` (a profiling aid, not a test).
    ncu -k regex:_sparse_verify_kernel -s 2 -c 1 --section ... python scripts/profile_sparse_verify.py
        [BATCH CONTEXT QO_LEN]
"""
import math
import sys

import torch

from m3_eagle_plugin.bench.inputs import Geometry
from m3_eagle_plugin.bench.kernel_suite import StepSet
from m3_eagle_plugin.msa.kernels.index_select import select_blocks_verify
from m3_eagle_plugin.msa.kernels.sparse_verify import sparse_verify_attention

USAGE = "usage: python scripts/profile_sparse_verify.py [BATCH CONTEXT QO_LEN]  (default 64 32768 4)"
if len(sys.argv) not in (1, 4):  # one or two numbers (or a flag) profiled the default shape unsaid
    sys.exit(f"{USAGE}\ngot {' '.join(sys.argv[1:])!r}")
try:
    batch, ctx, qo = (int(a) for a in (sys.argv[1:4] if len(sys.argv) == 4 else (64, 32768, 4)))
except ValueError:
    sys.exit(f"{USAGE}\nexpected three integers, got {' '.join(sys.argv[1:])!r}")
if batch < 1 or qo < 1 or ctx < qo:
    sys.exit(f"{USAGE}\nneed BATCH >= 1 and CONTEXT >= QO_LEN >= 1, got {batch} {ctx} {qo}")
geo = Geometry()
st = StepSet(batch, ctx, geo, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
             device=torch.device("cuda"), num_sets=1).step(0, qo)
for _ in range(4):
    sel, union = select_blocks_verify(st["index_q"], st["cache"].index_k, st["meta"], topk=geo.topk, max_qo_len=qo,
                                      union_group=geo.q_heads)
    sparse_verify_attention(st["q"], st["cache"].k, st["cache"].v, st["meta"], sel, scale=1 / math.sqrt(geo.head_dim),
                            k_scale=st["cache"].k_scale, v_scale=st["cache"].v_scale, max_qo_len=qo, union=union)
torch.cuda.synchronize()
