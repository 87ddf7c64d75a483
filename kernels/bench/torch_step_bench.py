#!/usr/bin/env python3
"""torch_step_bench.py: PyTorch's single recurrent step on the GPU at rnnd-kernel-bench --op step's shapes.

Usage (python3 with PyTorch and a CUDA device; the same options as rnnd-kernel-bench --op step):
  torch_step_bench.py --cell gru --batch 1024,1 --input 256 --hidden 256 --layers 1 \\
      --reset-prob 0,0.01,0.1 [--compute fp32|ieee] [--warmup 3] [--repeat 20] [--seed 1]

What a PyTorch actor server does for one step of B envs whose states live in a table of S = 4B
slots (the B slots a random permutation of the table's): index_select the rows' states, zero the
rows whose is_init is set, nn.GRUCell / nn.LSTMCell per layer, index_copy_ the new states back,
the top layer's h into a static output. Timed three ways, each per step, with CUDA events around
200 back-to-back runs, median of --repeat after --warmup:
  eager_us  the step as plain PyTorch calls;
  graph_us  the step captured in a torch.cuda.CUDAGraph, replayed;
  gpu_us    200 steps captured in one graph, replayed once: the device's own time per step;
  call_us   host clock around copy in (x, is_init from pinned memory), replay, copy out of the
            output to pinned memory and synchronize (median of 200 calls).
fp32 allows TF32 matmuls (as rnnd's fp32 mode and cuDNN do); ieee forbids them; bf16 is skipped.
Prints a table, then one JSON line per case (backend "torch-cuda", "op":"step").
"""
import itertools
import json
import time

import torch

import bench_args

LAUNCHES = 200


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def run_case(cell, B, I, H, L, p, args):
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    lstm = cell == "lstm"
    Cell = torch.nn.LSTMCell if lstm else torch.nn.GRUCell
    cells = [Cell(I if l == 0 else H, H).to(dev) for l in range(L)]
    S = 4 * B
    table_h = (torch.rand(S, L, H, generator=g) * 2 - 1).to(dev)
    table_c = (torch.rand(S, L, H, generator=g) * 2 - 1).to(dev) if lstm else None
    slots = torch.randperm(S, generator=g)[:B].to(dev)
    x = (torch.rand(B, I, generator=g) * 2 - 1).to(dev)
    is_init = (torch.rand(B, generator=g) < p).to(dev)
    out = torch.empty(B, H, device=dev)

    @torch.no_grad()
    def step():
        keep = (~is_init).to(x.dtype)[:, None, None]
        h = table_h.index_select(0, slots) * keep
        c = table_c.index_select(0, slots) * keep if lstm else None
        inp, hs, cs = x, [], []
        for l in range(L):
            if lstm:
                hl, cl = cells[l](inp, (h[:, l], c[:, l]))
                cs.append(cl)
            else:
                hl = cells[l](inp, h[:, l])
            hs.append(hl)
            inp = hl
        table_h.index_copy_(0, slots, torch.stack(hs, 1))
        if lstm:
            table_c.index_copy_(0, slots, torch.stack(cs, 1))
        out.copy_(inp)

    def events_us(fn, calls=LAUNCHES):
        """Microseconds per step of `calls` calls of fn, each running LAUNCHES / calls steps."""
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        v = []
        for i in range(-args.warmup, args.repeat):
            e0.record()
            for _ in range(calls):
                fn()
            e1.record()
            e1.synchronize()
            if i >= 0:
                v.append(1e3 * e0.elapsed_time(e1) / LAUNCHES)
        return median(v)

    eager = events_us(step)
    # Capture after warm-up on a side stream, as torch.cuda.graphs asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_us = events_us(graph.replay)
    graph_n = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_n):
        for _ in range(LAUNCHES):
            step()
    gpu_us = events_us(graph_n.replay, calls=1)

    x_host = x.cpu().pin_memory()
    init_host = is_init.cpu().pin_memory()
    out_host = torch.empty(B, H).pin_memory()
    v = []
    for i in range(-args.warmup * LAUNCHES, LAUNCHES):
        t0 = time.perf_counter()
        x.copy_(x_host, non_blocking=True)
        is_init.copy_(init_host, non_blocking=True)
        graph.replay()
        out_host.copy_(out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        if i >= 0:
            v.append((time.perf_counter() - t0) * 1e6)
    return {
        "op": "step", "backend": "torch-cuda",
        "device": "%s (torch %s)" % (torch.cuda.get_device_name(), torch.__version__),
        "cell": cell, "B": B, "I": I, "H": H, "L": L, "reset_prob": p,
        "compute": args.compute_now, "eager_us": round(eager, 3), "graph_us": round(graph_us, 3),
        "gpu_us": round(gpu_us, 3),
        "call_us": round(median(v), 3), "slots": S, "launches": LAUNCHES,
        "warmup": args.warmup, "repeat": args.repeat, "seed": args.seed,
    }


def main():
    ap = bench_args.parser(__doc__.splitlines()[0], batch=1024, input_size=256, hidden=256,
                           reset_prob=0.0, repeat=20)
    args = ap.parse_args()

    print("%-10s %-4s %-5s %5s %5s %5s %2s %6s %9s %9s %9s %9s" % (
        "backend", "cell", "comp", "B", "I", "H", "L", "reset", "eager_us", "graph_us", "gpu_us",
        "call_us"))
    results = []
    for cell, comp, L, H, I, B, p in itertools.product(
            args.cell, args.compute, args.layers, args.hidden, args.input, args.batch,
            args.reset_prob):
        if comp not in ("fp32", "ieee"):
            print("%-10s %-4s %-5s  skipped: only fp32 (TF32 allowed) and ieee" % (
                "torch-cuda", cell, comp))
            continue
        torch.backends.cuda.matmul.allow_tf32 = comp == "fp32"
        torch.backends.cudnn.allow_tf32 = comp == "fp32"
        args.compute_now = comp
        r = run_case(cell, B, I, H, L, p, args)
        results.append(r)
        print("%-10s %-4s %-5s %5d %5d %5d %2d %6.3f %9.2f %9.2f %9.2f %9.2f" % (
            r["backend"], cell, comp, B, I, H, L, p, r["eager_us"], r["graph_us"], r["gpu_us"],
            r["call_us"]), flush=True)
    for r in results:
        print(json.dumps(r, separators=(",", ":")))


if __name__ == "__main__":
    main()
