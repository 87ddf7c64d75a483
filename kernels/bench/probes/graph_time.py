# graph_time.py: the probes' timer. fn (which enqueues CUDA work) is captured n times into one
# CUDA graph, so that launches cost what they cost inside the per-step path's graphs; the graph
# is replayed reps + 2 times and the median of the last reps gives microseconds for one fn. n: 80,
# the per-step rows' steps. Importing it puts fp32 products in TF32, as the kernels' fp32 mode.
import torch

torch.backends.cuda.matmul.allow_tf32 = True


def graph_time(fn, n=80, reps=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    ts = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / n)
    ts = sorted(ts[2:])
    return ts[len(ts) // 2]
