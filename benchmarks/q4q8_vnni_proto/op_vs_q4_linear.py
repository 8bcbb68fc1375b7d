"""torch.ops.genserve.q4q8_linear (bf16 x, rounding fused) against torch.ops.genserve.q4_linear on
the same random Q4_1 blocks, SmolLM2-135M's shapes. `PYTHONPATH=$PWD python
benchmarks/q4q8_vnni_proto/op_vs_q4_linear.py [threads]`, the fastest of repeated calls"""
import sys
import time

import torch

from engine import kernels
from engine.model.quant import q4_pack, q4q8_pack

assert kernels.q4_linear_available() and kernels.q4q8_linear_available()
torch.manual_seed(0)
if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))
print("threads", torch.get_num_threads())


def bench(f, seconds=0.5):
    """The fastest of repeated calls: on a shared host the minimum is the least disturbed."""
    for _ in range(3):
        f()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


for n, k in [(1536, 576), (576, 1536), (3072, 576)]:
    kb = k // 32
    d = (torch.rand(n, kb) * 0.01 + 0.001).half()
    m = (-8 * d.float() * 0.9).half()
    nib = torch.randint(0, 256, (n, kb, 16), dtype=torch.uint8)
    blocks = torch.cat([d.view(torch.uint8).view(n, kb, 2), m.view(torch.uint8).view(n, kb, 2), nib],
                       -1).reshape(n, kb * 20).contiguous()
    p4, p8 = q4_pack(blocks), q4q8_pack(blocks)
    for rows in (1, 32, 512):
        x = torch.randn(rows, k).bfloat16()
        t4 = bench(lambda: torch.ops.genserve.q4_linear(x, p4, k))
        t8 = bench(lambda: torch.ops.genserve.q4q8_linear(x, p8, n))
        print(f"N={n} K={k} M={rows}: q4_linear {t4 * 1e6:.1f} us, q4q8_linear {t8 * 1e6:.1f} us "
              f"({2 * rows * n * k / t8 / 1e9:.0f} GFLOP/s), {t4 / t8:.2f}x", flush=True)
