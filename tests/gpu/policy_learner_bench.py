#!/usr/bin/env python3
# Issue 44: the learner iteration with the heads on the daemon beside the same learner with the
# heads in PyTorch, B=2048 T=64 I=64 H=128 GRU, 6 discrete actions + value, CUDA regions, one run.
# GPU host: RNND_BIN=rnnd-bundle/bin/rnnd PYTHONPATH=<the client's wheel, installed> python3 tests/gpu/policy_learner_bench.py
import statistics, sys, time
import numpy as np, torch
import rnnd
B, T, I, H, K = 2048, 64, 64, 128, 6
dev = torch.device("cuda")
flags = dict(backend="cuda", input_size=I, hidden_size=H, max_envs=4096, max_batch=2048,
             trajectory_steps=T, max_message_mb=512, tape_memory_mb=16384)
def run(heads):
    d = rnnd.Daemon(**flags, **(dict(discrete_actions=K, value_head=1) if heads else {})).start()
    try:
        c = rnnd.Client(d.target)
        rng = np.random.default_rng(0)
        ids = np.arange(B, dtype=np.uint64)
        for t in range(T):
            c.step_result(ids, rng.standard_normal((B, I)).astype(np.float32), is_init=(rng.random(B) < 0.01) | (t == 0))
        tgt = torch.randint(0, K, (B, T), device=dev); ret = torch.randn(B, T, device=dev)
        head = torch.nn.Linear(H, K + 1).to(dev); opt = torch.optim.Adam(head.parameters(), lr=1e-3)
        def loss_of(logits, value):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, K), tgt.reshape(-1)) + ((value - ret) ** 2).mean()
        def it():
            f = c.forward_recorded(ids, T, keep_tape=True, fields=(), device=dev)
            if heads:
                lg = f.logits.requires_grad_(); v = f.head_value.requires_grad_()
                loss_of(lg, v).backward()
                c.backward(f.tape_id, grad_logits=lg.grad, grad_head_value=v.grad, accumulate=True, input_grads=())
            else:
                out = f.output.requires_grad_()
                y = head(out); loss_of(y[..., :K], y[..., K]).backward()
                c.backward(f.tape_id, out.grad, accumulate=True, input_grads=())
                opt.step(); opt.zero_grad()
            c.apply_gradients()
        for _ in range(3): it()
        ts = []
        for _ in range(25):
            torch.cuda.synchronize(); s = time.perf_counter(); it(); torch.cuda.synchronize(); ts.append((time.perf_counter() - s) * 1e3)
        print("%-36s %7.2f ms (median of 25; min %.2f)  transport %s" % (
            "heads on the daemon" if heads else "core on the daemon, heads in PyTorch", statistics.median(ts), min(ts), c.transport), flush=True)
        c.close()
    finally:
        d.stop()
for _ in range(2):
    run(False); run(True)
