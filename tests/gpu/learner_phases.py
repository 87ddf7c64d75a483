#!/usr/bin/env python3
# Where a learner iteration's time goes (B=2048 T=64 I=64 H=128), phase by phase, then cProfile:
# through CUDA regions by default; DEVICES=0,1 (the daemon's --devices), TRANSPORT=socket (any
# rnnd.Client transport), WIRE=bfloat16 (the wire dtype) for others. DEVICE=cpu: the CPU backend
# and a CPU learner (B=256 unless B is set).
# GPU host: RNND_BIN=rnnd-bundle/bin/rnnd PYTHONPATH=rnnd-bundle/py python3 tests/gpu/learner_phases.py
import cProfile, os, pstats, statistics, sys, time
import numpy as np, torch
import rnnd, rnnd.torch
dev = torch.device(os.environ.get("DEVICE", "cuda"))
B, T, I, H = int(os.environ.get("B", 2048 if dev.type == "cuda" else 256)), 64, 64, 128
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
extra = {"devices": os.environ["DEVICES"]} if os.environ.get("DEVICES") else {}
d = rnnd.Daemon(backend=dev.type, input_size=I, hidden_size=H, max_envs=4096, max_batch=2048,
                trajectory_steps=T, max_message_mb=512, tape_memory_mb=8192, **extra).start()
try:
    c = rnnd.Client(d.target, transport=os.environ.get("TRANSPORT", "auto"))
    rng = np.random.default_rng(0)
    ids = np.arange(B, dtype=np.uint64)
    for t in range(T):
        c.step(ids, rng.standard_normal((B, I)).astype(np.float32), is_init=(rng.random(B) < 0.01) | (t == 0))
    core = rnnd.torch.RemoteRecurrent(c, grads="server", wire=os.environ.get("WIRE", "float32")).to(dev)
    head = torch.nn.Linear(H, 1).to(dev); opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    y = torch.randn(B, T, 1, device=dev)
    ph = {k: [] for k in ("forward", "loss", "backward", "apply", "opt", "rpc_info", "total")}
    def it(rec=True):
        s = time.perf_counter()
        out, _ = core.forward_recorded(ids, T, fields=("is_init",)); sync(); a = time.perf_counter()
        loss = torch.nn.functional.mse_loss(head(out), y); opt.zero_grad(); sync(); b = time.perf_counter()
        loss.backward(); sync(); cc = time.perf_counter()
        core.apply_gradients(pull=False); e = time.perf_counter()
        opt.step(); sync(); f = time.perf_counter()
        c.info(); g = time.perf_counter()
        if rec:
            for k, v in zip(ph, (a - s, b - a, cc - b, e - cc, f - e, g - f, f - s)):
                ph[k].append(v * 1e3)
    for _ in range(5): it(False)
    for _ in range(30): it()
    print("transport", c.transport)
    for k, v in ph.items():
        print("%-10s median %.3f ms" % (k, statistics.median(v)))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): it(False)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(int(os.environ.get("TOP", 25)))
finally:
    d.stop()
