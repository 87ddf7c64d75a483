# stepwise_dw.py: the per-step path's weight gradients, [dW_ih | dW_hh | db] = z^T D over all
# B*T rows (seq.cu: cuBLAS, TF32), at issue 45's per-step rows. ncu put it at 644 us at LSTM
# H = 512 B = 256 T = 80 (134 TFLOP/s, a quarter of the row): M = 4H = 2048 and N = ldz = 1028
# make 80 tiles of 128 x 256 for 132 SMs. Here as cuBLAS runs it (torch.mm) and split over K into
# s slices (torch.bmm; the scatter kernel that follows would add the slices). Microseconds,
# median of 7, each variant 5 times in one CUDA graph.
# Run on the GPU host from the repository root: python3 kernels/bench/probes/stepwise_dw.py
import torch
from graph_time import graph_time
dev = 'cuda'
rows = [('lstm', 256, 80, 512, 512), ('gru', 256, 80, 512, 512), ('lstm', 64, 80, 512, 1024)]


for cell, B, T, I, H in rows:
    BT = B * T
    ldz = (H + 1 + 3) // 4 * 4 + I
    ldz = (ldz + 3) // 4 * 4
    d = torch.randn(BT, 4 * H, device=dev)
    z = torch.randn(BT, ldz, device=dev)
    ref = torch.mm(z.t(), d)
    flop = 2 * BT * 4 * H * ldz
    res = []
    out = torch.empty(ldz, 4 * H, device=dev)
    res.append(('mm', graph_time(lambda: torch.mm(z.t(), d, out=out), 5), 0.0))
    out2 = torch.empty(4 * H, ldz, device=dev)
    res.append(('mm D^T z', graph_time(lambda: torch.mm(d.t(), z, out=out2), 5), 0.0))
    for s in (2, 3, 4, 5, 6, 8):
        if BT % s:
            continue
        z3 = z.view(s, BT // s, ldz).transpose(1, 2)
        d3 = d.view(s, BT // s, 4 * H)
        part = torch.empty(s, ldz, 4 * H, device=dev)
        us = graph_time(lambda: torch.bmm(z3, d3, out=part), 5)
        err = ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()
        res.append((f'{s} slices', us, err))
    print(f"{cell} B={B} T={T} I={I} H={H} (M=4H={4 * H}, N=ldz={ldz}, K={BT}): " + ", ".join(
        f"{n} {us:.1f} us ({flop / us / 1e6:.0f} TFLOP/s)" for n, us, e in res), flush=True)
