import pathlib, time, torch, os
from torch.utils.cpp_extension import load
ext = load("q4vnni", [str(pathlib.Path(__file__).with_name("q4vnni.cpp"))], extra_cflags=["-O3", "-march=native"], verbose=False)
torch.manual_seed(0)
def make(N, K):
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    d = torch.rand(N, K // 32) * 0.01 + 0.001
    m = -8 * d * (0.8 + 0.4 * torch.rand(N, K // 32))
    w = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    return q, d, m, w
def quant_x(x):
    M, K = x.shape
    xb = x.view(M, K // 32, 32)
    xs = xb.abs().amax(2) / 127
    xs = torch.where(xs == 0, torch.ones_like(xs), xs)
    xq = torch.round(xb / xs[..., None]).clamp(-127, 127).to(torch.int8)
    return xq.view(M, K).contiguous(), xs.contiguous(), (xs * xq.float().sum(2)).contiguous()
def bench(f, reps=10):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps
for (N, K) in [(1536, 576), (576, 1536), (3072, 576)]:
    q, d, m, w = make(N, K)
    packed = ext.pack(q, d, m)
    for M in [1, 32, 512]:
        x = torch.randn(M, K)
        xq, xs, xsum = quant_x(x)
        y = ext.gemm(xq, xs, xsum, packed, N)
        ref = (xq.float().view(M, K // 32, 32) * xs[..., None]).view(M, K) @ w.t()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        wb = w.bfloat16(); xb = x.bfloat16()
        t_v = bench(lambda: ext.gemm(xq, xs, xsum, packed, N))
        t_b = bench(lambda: torch.nn.functional.linear(xb, wb))
        t_q = bench(lambda: quant_x(x))
        fl = 2 * M * N * K
        print(f"N={N} K={K} M={M}: err {err:.1e}; vnni {t_v*1e3:.3f} ms ({fl/t_v/1e9:.0f} GFLOP/s), quant(torch) {t_q*1e3:.3f} ms; bf16 F.linear {t_b*1e3:.3f} ms ({fl/t_b/1e9:.0f}); ratio {t_b/t_v:.2f}x", flush=True)
