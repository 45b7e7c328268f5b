"""Host (Python) time of one FlashAttention-4 forward + backward behind SDPA (``train.attention_kernel
= "fa4"``), by function: cProfile over 50 calls at the reference shape (b 4, s 2048, 16 heads of 128,
causal, bf16). FA4 launches its kernels from Python; this shows where that time goes.

    bash benchmarks/gpu/fa4_install.sh && python3 benchmarks/gpu/fa4_host_profile.py
"""

import cProfile, pstats, io, torch, torch.nn.functional as F
from mtl.parallel.backend_local.fa4 import activate_fa4
activate_fa4(torch.device("cuda"))
q, k, v = (torch.randn(4, 2048, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
def call():
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    o.sum().backward()
for _ in range(5): call()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(50): call()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue())
