#!/usr/bin/python3
"""Learner benchmark: the rnnd learner loop beside the same learner in plain PyTorch, one process,
one run, one device.

rnnd (through rnnd.torch.RemoteRecurrent, Python client over TCP loopback; one row per
--transports entry: grpc, shm, cuda, socket or auto, see rnnd.Client's transport, each with its
unary calls through the C client where rnnd finds it, or with ":grpcio" after it through grpcio):
    Forward(recorded, keep_tape, only is_init back) -> linear head + MSE loss on the learner's
    device -> loss.backward() = Backward(accumulate, no input gradients) -> ApplyGradients (the
    daemon's Adam) and the head's Adam step.
PyTorch, the same GRU, head, loss and Adam over the same windows:
    cudnn:    nn.GRU over whole rows (ignores the resets inside the windows: the fastest possible
              and not the same math);
    per-step: a loop over the T steps with GRUCell, zeroing the state where is_init (the resets
              done right, as a PyTorch learner without rnnd does them).

Every row prints the iteration time (median over --iters, and the minimum) and env-steps/s (B*T
per iteration). The rnnd row adds the daemon's own time per call from its /metrics
(rnnd_request_duration_seconds: request arrival to status, over the timed iterations) and the
backend ops' time in it.

    # CPU, small shape (the daemon started from a path):
    PYTHONPATH=build/client/python /usr/bin/python3 client/python/examples/learner_bench.py \\
        --rnnd build/server/rnnd --backend cpu -B 256 -T 64
    # GPU host, the issue's shape, bf16 on the wire:
    PYTHONPATH=build/client/python python3 client/python/examples/learner_bench.py \\
        --rnnd build/server/rnnd --backend cuda --device cuda -B 2048 -T 64 --wire bfloat16
"""

import argparse
import re
import statistics
import sys
import time
import urllib.request

import numpy as np
import torch

import rnnd
import rnnd.torch


def metrics(http):
    with urllib.request.urlopen("http://%s/metrics" % http, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^(rnnd_request_duration_seconds_(?:sum|count))\{method="(\w+)"\} (\S+)$'
                         r'|^rnnd_backend_kernel_seconds_total\{op="(\w+)"\} (\S+)$', text, re.M):
        if m.group(1):
            out[(m.group(1).rsplit("_", 1)[1], m.group(2))] = float(m.group(3))
        else:
            out[("kernel", m.group(4))] = float(m.group(5))
    return out


def adam(params, a):
    """The learner's Adam (--adam): fused, one kernel for all tensors (GPU only), or foreach."""
    return torch.optim.Adam(params, lr=1e-3, fused=a.adam == "fused")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, warmup, device):
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def row(name, sec, B, T, extra=""):
    """sec: (median, minimum) seconds of an iteration."""
    print("%-40s %9.2f ms (min %.2f)  %12.0f env-steps/s  %s"
          % (name, sec[0] * 1e3, sec[1] * 1e3, B * T / sec[0], extra), flush=True)


def rnnd_row(client, ids, T, B, H, target_y, dev, a, http):
    """The rnnd learner loop through client: one row, with the daemon's own time per call."""
    core = rnnd.torch.RemoteRecurrent(client, grads=a.grads, wire=a.wire).to(dev)
    head = torch.nn.Linear(H, 1).to(dev)
    opt = adam(head.parameters(), a)

    def rnnd_iter():
        # The learner takes the window's resets (as a loss mask would); the recorded obs,
        # extras and versions stay on the daemon.
        out, _ = core.forward_recorded(ids, T, fields=("is_init",))
        loss = torch.nn.functional.mse_loss(head(out.to(dev)), target_y)
        opt.zero_grad()
        loss.backward()
        core.apply_gradients(pull=False)
        opt.step()

    for _ in range(a.warmup):
        rnnd_iter()
    m0 = metrics(http) if http else {}
    sec = timed(rnnd_iter, a.iters, 0, dev)
    extra = ""
    if http:
        m1 = metrics(http)
        parts = []
        for meth, op in (("Forward", "forward"), ("Backward", "backward"),
                         ("ApplyGradients", "optim")):
            n = m1.get(("count", meth), 0) - m0.get(("count", meth), 0)
            if n:
                s = (m1[("sum", meth)] - m0.get(("sum", meth), 0)) / n
                k = (m1.get(("kernel", op), 0) - m0.get(("kernel", op), 0)) / n
                parts.append("%s %.2f ms (backend %.2f)" % (meth, s * 1e3, k * 1e3))
        extra = "daemon: " + ", ".join(parts)
    path = client.transport
    if path == "socket":
        path += " x%d" % client._sock_conns
    row("rnnd %s (%s wire, %s, %s)" % (path, a.wire, a.grads,
                                       "native" if client.native else "grpcio"), sec, B, T, extra)
    client.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rnnd", help="the rnnd binary to start, or a command line that starts it "
                    "(a bundle's \"BUNDLE/run rnnd\"); else --target")
    ap.add_argument("--target", help="HOST:PORT of a running rnnd (with --http for its metrics)")
    ap.add_argument("--http", help="HOST:PORT of that rnnd's HTTP port")
    ap.add_argument("--backend", default="cpu", help="the daemon's --backend (cpu, cuda, auto)")
    ap.add_argument("--device", default="cpu", help="the learner's torch device (cpu, cuda)")
    ap.add_argument("--devices", help="the daemon's --devices (e.g. 0,1: the batch split by env "
                    "over two GPUs)")
    ap.add_argument("-B", type=int, default=256)
    ap.add_argument("-T", type=int, default=64)
    ap.add_argument("-I", type=int, default=64)
    ap.add_argument("-H", type=int, default=128)
    ap.add_argument("--reset-prob", type=float, default=0.01)
    ap.add_argument("--wire", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    ap.add_argument("--adam", choices=("fused", "foreach"),
                    help="the learner's Adam in every row (default: fused on a GPU, else foreach)")
    ap.add_argument("--grads", default="server", choices=("server", "apply"),
                    help="RemoteRecurrent's grads: server (Backward, then ApplyGradients) or apply "
                         "(Backward takes the optimizer step too: one call less)")
    ap.add_argument("--transports", default="auto",
                    help="comma-separated rnnd.Client transports, one rnnd row each "
                         "(auto, grpc, shm, cuda, socket; cuda:grpcio makes the calls on grpcio, "
                         "socket:1 uses one data connection instead of 4)")
    a = ap.parse_args()
    B, T, I, H = a.B, a.T, a.I, a.H
    dev = torch.device(a.device)
    a.adam = a.adam or ("fused" if dev.type == "cuda" else "foreach")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    d = None
    if a.rnnd:
        extra = {"devices": a.devices} if a.devices else {}
        d = rnnd.Daemon(binary=a.rnnd.split(), backend=a.backend, input_size=I, hidden_size=H,
                        max_envs=max(B, 1024), max_batch=min(B, 4096), trajectory_steps=T,
                        max_message_mb=512, tape_memory_mb=8192, **extra).start()
        target, http = d.target, d.http
    else:
        target, http = a.target, a.http
    try:
        client = rnnd.Client(target, max_message_mb=-1)
        info = client.info()
        print("rnnd %s on %s, GRU I=%d H=%d, B=%d T=%d, reset p=%g, wire %s; learner on %s, "
              "%s Adam" % (info.backend, info.device, I, H, B, T, a.reset_prob, a.wire, dev,
                           a.adam), flush=True)
        # The windows: T recorded steps of B envs, resets at random.
        ids = np.arange(B, dtype=np.uint64)
        obs = rng.standard_normal((T, B, I)).astype(np.float32)
        init = rng.random((T, B)) < a.reset_prob
        init[0] = True
        for t in range(T):
            for lo in range(0, B, info.max_batch):
                s = slice(lo, lo + info.max_batch)
                client.step(ids[s], obs[t, s], is_init=init[t, s])
        target_y = torch.randn(B, T, 1, device=dev)

        for entry in a.transports.split(","):
            transport, _, opt = entry.partition(":")
            rnnd_row(rnnd.Client(target, max_message_mb=-1, transport=transport,
                                 native=False if opt == "grpcio" else None,
                                 sock_conns=int(opt) if opt.isdigit() else 4),
                     ids, T, B, H, target_y, dev, a, http)

        if not a.no_torch:
            x = torch.from_numpy(obs.transpose(1, 0, 2).copy()).to(dev)     # [B, T, I]
            resets = torch.from_numpy(init.T.copy()).to(dev)                 # [B, T]
            gru = torch.nn.GRU(I, H, batch_first=True).to(dev)
            cell = torch.nn.GRUCell(I, H).to(dev)
            for name, net in (("cudnn", gru), ("per-step", cell)):
                head2 = torch.nn.Linear(H, 1).to(dev)
                opt2 = adam(list(net.parameters()) + list(head2.parameters()), a)

                def torch_iter(net=net, head2=head2, opt2=opt2, name=name):
                    if name == "cudnn":
                        out, _ = net(x)
                    else:
                        h = torch.zeros(B, H, device=dev)
                        outs = []
                        for t in range(T):
                            h = torch.where(resets[:, t, None], torch.zeros_like(h), h)
                            h = net(x[:, t], h)
                            outs.append(h)
                        out = torch.stack(outs, 1)
                    loss = torch.nn.functional.mse_loss(head2(out), target_y)
                    opt2.zero_grad()
                    loss.backward()
                    opt2.step()

                label = ("PyTorch %s" % name) + (" (no resets)" if name == "cudnn" else "")
                row(label, timed(torch_iter, a.iters, a.warmup, dev), B, T)
    finally:
        if d is not None:
            d.stop()


if __name__ == "__main__":
    sys.exit(main())
