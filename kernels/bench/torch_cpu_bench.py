#!/usr/bin/python3
"""torch_cpu_bench.py: PyTorch's CPU GRU/LSTM at rnnd-kernel-bench's shapes, for comparison.

Usage (Debian's /usr/bin/python3 with python3-torch; the same options as rnnd-kernel-bench):
  torch_cpu_bench.py --cell gru --batch 64 --steps 128 --input 64 --hidden 128 --layers 1 \\
      --reset-prob 0.1 [--warmup 3] [--repeat 10] [--seed 1] [--threads N] [--grad-input]

Times forward (autograd on, as a training forward) and forward+backward with torch.nn.GRU /
nn.LSTM, batch-first, fp32. With reset probability 0 the whole sequence is one nn.GRU call (the
fused ATen path); with resets, as TorchRL-style recurrent modules do, a per-step loop calls the
module on one step at a time and zeroes the state of the rows whose is_init is set first. The
output gradient is random; the input gradient is computed only with --grad-input (as in
rnnd-kernel-bench). Prints a table, then one JSON line per case (backend "torch-cpu"); list
options take comma lists like rnnd-kernel-bench's. --compute accepts only fp32/ieee (the same on
a CPU); bf16 cases are skipped with a note.
"""
import itertools
import json
import time

import torch

import bench_args


def run_case(cell, B, T, I, H, L, p, args):
    g = torch.Generator().manual_seed(args.seed)
    mod = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(I, H, L, batch_first=True)
    x = (torch.rand(B, T, I, generator=g) * 2 - 1).requires_grad_(args.grad_input)
    is_init = torch.rand(B, T, generator=g) < p
    grad_out = torch.rand(B, T, H, generator=g) * 2 - 1
    keep = (~is_init).float().t().reshape(T, 1, B, 1)  # (T, 1, B, 1): 0 where a row resets

    def forward():
        if p == 0:
            out, _ = mod(x)
            return out
        h = torch.zeros(L, B, H)
        c = torch.zeros(L, B, H)
        outs = []
        for t in range(T):
            h = h * keep[t]
            if cell == "lstm":
                c = c * keep[t]
                o, (h, c) = mod(x[:, t:t + 1], (h, c))
            else:
                o, h = mod(x[:, t:t + 1], h)
            outs.append(o)
        return torch.cat(outs, 1)

    def fwdbwd():
        forward().backward(grad_out)

    def timed(fn):
        for _ in range(args.warmup):
            fn()
        ts = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        n = len(ts)
        med = ts[n // 2] if n % 2 else 0.5 * (ts[n // 2 - 1] + ts[n // 2])
        return med, ts[0]

    fwd, fwd_min = timed(forward)
    fb, fb_min = timed(fwdbwd)
    G = 4 if cell == "lstm" else 3
    flops = sum(2.0 * B * T * G * H * ((I if l == 0 else H) + H) for l in range(L))
    return {
        "backend": "torch-cpu",
        "device": f"cpu (torch {torch.__version__}, {torch.get_num_threads()} threads)",
        "cell": cell, "B": B, "T": T, "I": I, "H": H, "L": L, "reset_prob": p,
        "compute": "fp32", "fwd_ms": round(fwd, 4), "fwdbwd_ms": round(fb, 4),
        "fwd_min_ms": round(fwd_min, 4), "fwdbwd_min_ms": round(fb_min, 4),
        "fwdbwd_gflops": round(3 * flops / (fb * 1e6), 2), "grad_input": args.grad_input,
        "warmup": args.warmup, "repeat": args.repeat, "seed": args.seed,
        "mode": "nn.%s" % cell.upper() if p == 0 else "per-step loop",
    }


def main():
    ap = bench_args.parser(__doc__.splitlines()[0], batch=64, input_size=64, hidden=128,
                           reset_prob=0.1, repeat=10)
    ap.add_argument("--steps", type=bench_args.int_list, default=[128])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--grad-input", action="store_true")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    print("%-9s %-4s %-5s %5s %5s %5s %5s %2s %6s %10s %10s %8s  %s" % (
        "backend", "cell", "comp", "B", "T", "I", "H", "L", "reset", "fwd_ms", "fwdbwd_ms",
        "GFLOP/s", "mode"))
    results = []
    for cell, comp, L, H, I, B, T, p in itertools.product(
            args.cell, args.compute, args.layers, args.hidden, args.input, args.batch,
            args.steps, args.reset_prob):
        if comp not in ("fp32", "ieee"):
            print("%-9s %-4s %-5s  skipped: bf16 is not timed for torch on the CPU" % (
                "torch-cpu", cell, comp))
            continue
        r = run_case(cell, B, T, I, H, L, p, args)
        r["compute"] = comp
        results.append(r)
        print("%-9s %-4s %-5s %5d %5d %5d %5d %2d %6.3f %10.3f %10.3f %8.1f  %s" % (
            r["backend"], cell, comp, B, T, I, H, L, p, r["fwd_ms"], r["fwdbwd_ms"],
            r["fwdbwd_gflops"], r["mode"]), flush=True)
    for r in results:
        print(json.dumps(r, separators=(",", ":")))


if __name__ == "__main__":
    main()
