# stepwise_layout.py: where the per-step path's time goes (issue 45's rows H >= 256). For each
# row, per step: hg = hprev W_hh^T (cuBLAS through torch.mm, TF32) and one elementwise pass over
# xg + hg, with the tape's rows T apart as today (bm) or contiguous (tm, time-major); T steps in
# a CUDA graph, and the pair also launched eagerly from Python. Prints microseconds a step.
# Run on the GPU host from the repository root (PyTorch with CUDA):
#   python3 kernels/bench/probes/stepwise_layout.py
# Log: kernels/bench/results/h200_stepwise_probe_2026-11-29.log.
import torch
torch.backends.cuda.matmul.allow_tf32 = True
dev = 'cuda'
rows = [('gru', 2048, 256, 64, 256), ('lstm', 256, 80, 512, 512), ('gru', 256, 80, 512, 512),
        ('lstm', 64, 80, 512, 1024), ('gru', 2048, 256, 64, 64)]
def timeit(fn, reps=5):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts = sorted(ts[2:])
    return ts[len(ts) // 2]
def eager(fn, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]
for cell, B, T, I, H in rows:
    G = 3 if cell == 'gru' else 4
    GH = G * H
    ldz = H + 8 + I + ((-(H + 8 + I)) % 4)
    W = torch.randn(GH, H, device=dev) * 0.05
    zb = torch.randn(B * T * ldz, device=dev)
    xg = torch.randn(B * T * GH, device=dev)
    hg = torch.empty(B, GH, device=dev)
    out = torch.empty(B, GH, device=dev)
    def step_bm(t):
        hp = zb.as_strided((B, H), (T * ldz, 1), t * ldz)
        torch.mm(hp, W.t(), out=hg)
    def step_tm(t):
        hp = zb.as_strided((B, H), (ldz, 1), t * B * ldz)
        torch.mm(hp, W.t(), out=hg)
    def cell_bm(t):
        torch.add(xg.as_strided((B, GH), (T * GH, 1), t * GH), hg, out=out)
    def cell_tm(t):
        torch.add(xg.as_strided((B, GH), (GH, 1), t * B * GH), hg, out=out)
    res = {}
    for name, f in [('gemm_bm', step_bm), ('gemm_tm', step_tm), ('cell_bm', cell_bm), ('cell_tm', cell_tm)]:
        res[name] = timeit(lambda: [f(t) for t in range(T)]) / T * 1000
    both_bm = lambda: [(step_bm(t), cell_bm(t)) for t in range(T)]
    res['eager_both_bm'] = eager(both_bm) / T * 1000
    res['graph_both_bm'] = timeit(both_bm) / T * 1000
    flops = 2 * B * H * GH
    print(f"{cell} B={B} T={T} I={I} H={H}: per step us " +
          " ".join(f"{k}={v:.2f}" for k, v in res.items()) +
          f"  gemm TFLOP/s bm={flops/res['gemm_bm']/1e6:.0f} tm={flops/res['gemm_tm']/1e6:.0f}", flush=True)
