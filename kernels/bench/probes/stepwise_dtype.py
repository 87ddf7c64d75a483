# stepwise_dtype.py: the per-step path's two GEMMs at issue 45's per-step rows with fp32 operands
# (cuBLAS in TF32, as TF32 mode runs them today) against 16-bit operands (fp16 and bf16, fp32
# accumulation). h is bounded and W_hh fixed for a call, so fp16 copies of them (10 mantissa bits,
# TF32's) would keep TF32 mode's precision at half the bytes: is the GEMM faster for it?
# forward hg (B, GH) = hprev (B, H) W_hh^T, backward dh (B, H) = D_h (B, GH) W_hh. Each variant:
# 80 of it in one CUDA graph, replayed; microseconds a GEMM, median of 7.
# Run on the GPU host from the repository root: python3 kernels/bench/probes/stepwise_dtype.py
import torch
from graph_time import graph_time
dev = 'cuda'
rows = [('lstm', 256, 512), ('gru', 256, 512), ('lstm', 64, 1024), ('gru', 2048, 256)]


def mm_out32(a, b, out):
    """a @ b into fp32 out; 16-bit operands accumulate in fp32 (out_dtype where torch has it)."""
    try:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
        return True
    except TypeError:
        return False


for cell, B, H in rows:
    G = 3 if cell == 'gru' else 4
    GH = G * H
    w = torch.randn(GH, H, device=dev) / H ** 0.5
    for name, a, b in (('fwd', torch.rand(B, H, device=dev) * 2 - 1, w.t()),
                       ('bwd', torch.randn(B, GH, device=dev), w)):
        M, K = a.shape
        N = b.shape[1]
        ref = torch.mm(a.double(), b.double())
        res = []
        out = torch.empty(M, N, device=dev)
        res.append(('tf32', graph_time(lambda: torch.mm(a, b, out=out)), out))
        for dt, tag in ((torch.float16, 'fp16'), (torch.bfloat16, 'bf16')):
            a16, b16 = a.to(dt), b.contiguous().to(dt)
            o32 = torch.empty(M, N, device=dev)
            if mm_out32(a16, b16, o32):
                res.append((tag + '>fp32', graph_time(lambda: mm_out32(a16, b16, o32)), o32))
            o16 = torch.empty(M, N, device=dev, dtype=dt)
            res.append((tag + '>' + tag, graph_time(lambda: torch.mm(a16, b16, out=o16)), o16))
        flop = 2 * M * N * K
        print(f"{cell} B={B} H={H} {name} M={M} N={N} K={K}: " + ", ".join(
            f"{t} {us:.2f} us ({flop / us / 1e6:.0f} TFLOP/s, err {((o.double() - ref).abs().max() / ref.abs().max()).item():.1e})"
            for t, us, o in res), flush=True)

# The backward's product in s K slices (fp16, a strided batch, as seq.cu runs it; the next kernel
# adds the slices): which s is fastest with 16-bit operands?
print("backward, fp16 K slices (bmm, no sum):")
for cell, B, H in rows:
    G = 3 if cell == 'gru' else 4
    GH = G * H
    d16 = torch.randn(B, GH, device=dev).half()
    w16 = (torch.randn(GH, H, device=dev) / H ** 0.5).half()
    res = []
    for s in (1, 2, 4, 8, 16):
        a3 = d16.view(B, s, GH // s).transpose(0, 1)
        b3 = w16.view(s, GH // s, H)
        out = torch.empty(s, B, H, device=dev, dtype=torch.half)
        res.append((s, graph_time(lambda: torch.bmm(a3, b3, out=out))))
    print(f"  {cell} B={B} H={H}: " + ", ".join(f"{s} slices {us:.2f} us" for s, us in res), flush=True)
