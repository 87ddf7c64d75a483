# stepwise_splitk.py: the per-step path's two GEMMs at issue 45's per-step rows, each as cuBLAS
# runs it (torch.mm, TF32) and split over K into s slices (torch.bmm over the slices, then a sum):
# forward hg (B, GH) = hprev (B, H) W_hh^T, backward dh (B, H) = D_h (B, GH) W_hh. Few output
# tiles at small B leave most of the 132 SMs idle; splitting K gives each slice its own tiles.
# Each variant: 80 of it in one CUDA graph, replayed; microseconds a GEMM, median of 7.
# Run on the GPU host from the repository root: python3 kernels/bench/probes/stepwise_splitk.py
import torch
from graph_time import graph_time
dev = 'cuda'
rows = [('gru', 2048, 256), ('lstm', 256, 512), ('gru', 256, 512), ('lstm', 64, 1024)]


for cell, B, H in rows:
    G = 3 if cell == 'gru' else 4
    GH = G * H
    w = torch.randn(GH, H, device=dev) / H ** 0.5
    for name, M, K, a, b in (('fwd', B, H, torch.randn(B, H, device=dev), w.t()),
                             ('bwd', B, GH, torch.randn(B, GH, device=dev), w)):
        N = b.shape[1]
        out = torch.empty(M, N, device=dev)
        res = [('mm', graph_time(lambda: torch.mm(a, b, out=out)))]
        ref = torch.mm(a, b)
        for s in (2, 4, 8, 16):
            if K % s:
                continue
            a3 = a.view(M, s, K // s).transpose(0, 1)  # (s, M, K/s), strided like the tape's rows
            b3 = b.reshape(s, K // s, N) if b.is_contiguous() else b.contiguous().view(s, K // s, N)
            part = torch.empty(s, M, N, device=dev)
            def f(a3=a3, b3=b3, part=part):
                torch.bmm(a3, b3, out=part)
                torch.sum(part, 0, out=out)
            f()
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            res.append((f'split{s}', graph_time(f), err))
        flop = 2 * M * N * K
        print(f"{cell} B={B} H={H} {name} M={M} N={N} K={K}: " + ", ".join(
            f"{r[0]} {r[1]:.2f} us ({flop / r[1] / 1e6:.0f} TFLOP/s)" for r in res))
