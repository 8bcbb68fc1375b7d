import sys, time, torch
import pathlib; HERE = pathlib.Path(__file__).parent; sys.path.insert(0, str(HERE.parent.parent))
from engine import kernels
from engine.model.quant import q4_pack

print("kernels", kernels.available())
from torch.utils.cpp_extension import load
ext = load("q4vnni", [str(HERE / "q4vnni.cpp")], extra_cflags=["-O3", "-march=native"])
torch.manual_seed(0)
def bench(f, reps=200):
    for _ in range(10): f()
    t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps
for N, K in [(1536, 576), (576, 1536), (3072, 576)]:
    kb = K // 32
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    d = (torch.rand(N, kb) * 0.01 + 0.001).half()
    m = (-8 * d.float() * 0.9).half()
    # ggml block_q4_1: d fp16, m fp16, byte i: q[i] | q[i+16] << 4
    qb = q.view(N, kb, 32)
    nib = qb[..., :16] | (qb[..., 16:] << 4)
    blocks = torch.cat([d.view(torch.uint8).view(N, kb, 2), m.view(torch.uint8).view(N, kb, 2), nib], -1).reshape(N, kb * 20).contiguous()
    packed_q4 = q4_pack(blocks)
    packed_v = ext.pack(q, d.float(), m.float())
    for M in (1, 4, 32):
        x = torch.randn(M, K).bfloat16()
        for chunk in (0, K):
            try:
                t4 = bench(lambda: torch.ops.genserve.q4_linear(x, packed_q4, chunk))
                break
            except RuntimeError as e:
                t4 = float("nan"); err = e
        xs = x.float().view(M, kb, 32); sc = xs.abs().amax(2) / 127; xq = torch.round(xs / sc[..., None]).to(torch.int8)
        xsum = sc * xq.float().sum(2); xq = xq.view(M, K).contiguous()
        tv = bench(lambda: ext.gemm(xq, sc.contiguous(), xsum.contiguous(), packed_v, N))
        print(f"N={N} K={K} M={M}: q4_linear {t4*1e6:.1f} us, vnni proto {tv*1e6:.1f} us (without rounding x), ratio {t4/tv:.2f}", flush=True)
