"""rnnd.torch's custom ops under torch.compile and torch.export, for a host with PyTorch >= 2.4
(the GPU host; Debian's torch 1.13 has neither API, and CI tests the eager path instead).

    python3 client/python/tests/gpu_torch_compile_check.py --rnnd PATH [--backend cpu|cuda]

PATH is the rnnd binary, or a command that runs it ("rnnd-bundle/run rnnd" for a bundle from
deploy/bundle.sh). The rnnd package must be importable: `pip install ./client/python` where
protoc is, or a wheel made here (`pip wheel --no-build-isolation --no-index --no-deps -w DIR
./client/python`) installed there with `pip install --no-deps DIR/rnnd-*.whl`.

Checks, each logged PASS or FAIL (exit status 1 if any failed):
  1. learner, grads="local": loss = MSE of a local head over RemoteRecurrent(obs, is_init), under
     torch.compile(fullgraph=True) and eagerly, on the same daemon weights, for several
     iterations with a daemon optimizer step between them: losses and every gradient (the
     core's Parameters from the daemon's Backward, the head's, the inputs') must agree, and the
     compiled function must be one graph compiled once.
  2. learner, grads="server" over recorded trajectories: two daemons with the same seed and the
     same recorded steps, one trained eagerly and one compiled (forward_recorded, Backward
     accumulated on the daemon, ApplyGradients); losses per iteration and the final weights must
     agree (a compiled graph that dropped the accumulating Backward would leave them apart).
  3. actor: a module calling rnnd::step (through RemoteRecurrent.step) exports with
     torch.export; the exported graph holds the op (not a constant), runs, saves and loads, and
     gives the outputs the eager module gives for the same observations.
The head runs on CUDA when there is a GPU (--device), the daemon on --backend (default cpu).
"""

import argparse
import io
import shlex
import sys
import time
import traceback

import numpy as np
import torch

try:
    import rnnd
    import rnnd.torch
except ImportError as e:
    sys.exit("FAIL: cannot import rnnd (%s): pip install ./client/python, or a wheel (see --help)"
             % e)

I, H, L, OUT = 5, 16, 2, 3
RTOL = 1e-4
results = []


def log(msg):
    print(msg, flush=True)


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def check(name, fn):
    t0 = time.monotonic()
    try:
        detail = fn()
        results.append((name, True))
        log("PASS %s (%.1f s)%s" % (name, time.monotonic() - t0, ": " + detail if detail else ""))
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
        results.append((name, False))
        traceback.print_exc()
        log("FAIL %s: %s" % (name, e))


def expect_close(what, got, want):
    e = rel(got, want)
    if not e <= RTOL:
        raise AssertionError("%s: relative error %.3g > %g" % (what, e, RTOL))
    return e


def graphs_compiled():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def learner_local(a, dev):
    torch._dynamo.reset()
    graphs = graphs_compiled()
    with a.daemon(cell="lstm", seed=1) as d:
        core = rnnd.torch.RemoteRecurrent(d.client()).to(dev)
        head = torch.nn.Linear(H, OUT).to(dev)

        def loss_fn(obs, is_init, h0, c0, y):
            out, (h_n, c_n) = core(obs, is_init, (h0, c0))
            return ((head(out) - y) ** 2).mean() + 0.1 * (h_n ** 2).mean()

        compiled = torch.compile(loss_fn, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        worst, losses = 0.0, []
        for it in range(a.iters):
            B, T = 4, 6
            obs = torch.randn(B, T, I, generator=g).to(dev)
            is_init = (torch.rand(B, T, generator=g) < 0.2).to(dev)
            h0 = torch.randn(B, L, H, generator=g).to(dev)
            c0 = torch.randn(B, L, H, generator=g).to(dev)
            y = torch.randn(B, T, OUT, generator=g).to(dev)
            runs = []
            for fn in (loss_fn, compiled):
                for p in (*core.parameters(), *head.parameters()):
                    p.grad = None
                ins = [t.clone().requires_grad_() for t in (obs, h0, c0)]
                loss = fn(ins[0], is_init, ins[1], ins[2], y)
                loss.backward()
                grads = {n: p.grad.clone() for n, p in (*core.named_parameters(),
                                                         *head.named_parameters())}
                grads.update(obs=ins[0].grad, h0=ins[1].grad, c0=ins[2].grad)
                runs.append((loss.detach(), grads))
            (le, ge), (lc, gc) = runs
            worst = max(worst, expect_close("iteration %d loss" % it, lc, le))
            for n in ge:
                worst = max(worst, expect_close("iteration %d grad %s" % (it, n), gc[n], ge[n]))
            losses.append(float(le))
            core.apply_gradients(lr=0.05)  # sends the compiled run's .grad; pulls the new weights
            opt.step()
        n = graphs_compiled() - graphs
        if n != 1:
            raise AssertionError("%d graphs compiled, want 1 (a recompile or a graph break)" % n)
        return "losses %s, worst relative difference %.2g, 1 graph" % (
            " ".join("%.4f" % v for v in losses), worst)


def learner_server(a, dev):
    torch._dynamo.reset()
    B, T = 6, 5
    ids = torch.arange(B, dtype=torch.int64) + 100
    g = torch.Generator().manual_seed(1)
    obs = torch.randn(T, B, I, generator=g)
    with a.daemon(cell="gru", seed=2, extras_size=1) as da, \
            a.daemon(cell="gru", seed=2, extras_size=1) as db:
        cores = []
        for d in (da, db):
            c = d.client()
            for t in range(T):
                c.step(ids.numpy(), obs[t].numpy(), t == 0, extras=np.full((B, 1), t, np.float32))
            cores.append(rnnd.torch.RemoteRecurrent(c, grads="server").to(dev))
        head = torch.nn.Linear(H, 1).to(dev)

        def make(core):
            def loss_fn(ids):
                out, rec = core.forward_recorded(ids, T)
                return ((head(out)[..., 0] - rec.extras[..., 0]) ** 2).mean()
            return loss_fn

        fns = (make(cores[0]), torch.compile(make(cores[1]), fullgraph=True))
        w0 = cores[0].client.get_weights()
        losses = []
        for it in range(a.iters):
            pair = []
            for core, fn in zip(cores, fns):
                loss = fn(ids)
                loss.backward()  # accumulated on that core's daemon
                core.apply_gradients(lr=0.05)
                pair.append(loss.detach())
            expect_close("iteration %d loss" % it, pair[1], pair[0])
            losses.append(float(pair[0]))
        wa, wb = (c.client.get_weights() for c in cores)
        if all(np.array_equal(wa[n], w0[n]) for n in wa):
            raise AssertionError("the eager learner's updates left the weights as they were")
        for n in wa:
            expect_close("final weight " + n, torch.from_numpy(np.array(wb[n])),
                         torch.from_numpy(np.array(wa[n])))
        return "losses %s, final weights equal" % " ".join("%.4f" % v for v in losses)


def actor_export(a, dev):
    class Actor(torch.nn.Module):
        def __init__(self, core):
            super().__init__()
            self.core = core
            self.policy = torch.nn.Linear(H, OUT)

        def forward(self, env_ids, obs, is_init):
            h = self.core.step(env_ids, obs, is_init)
            return h, self.policy(h)

    with a.daemon(cell="gru", seed=3) as d:
        actor = Actor(rnnd.torch.RemoteRecurrent(d.client())).to(dev)
        B = 8
        g = torch.Generator().manual_seed(2)
        obs = [torch.randn(B, I, generator=g).to(dev) for _ in range(4)]
        init = [torch.full((B,), t == 0, dtype=torch.bool, device=dev) for t in range(4)]
        ids = [torch.arange(B, dtype=torch.int64) + 1000 * k for k in range(3)]
        ep = torch.export.export(actor, (ids[0], obs[0], init[0]))
        ops = [n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"]
        if torch.ops.rnnd.step.default not in ops:
            raise AssertionError("rnnd::step is not in the exported graph: %s" % ops)
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        loaded = torch.export.load(buf)
        # Three env sets take the same observations: eager, exported, exported after a load.
        for t in range(4):
            want = actor(ids[0], obs[t], init[t])
            for k, prog in ((1, ep), (2, loaded)):
                got = prog.module()(ids[k], obs[t], init[t])
                for what, x, y in zip(("state", "logits"), got, want):
                    expect_close("step %d, program %d, %s" % (t, k, what), x, y)
        return "rnnd::step in the graph; exported and loaded programs match eager over 4 steps"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rnnd", required=True, help="the rnnd binary or a command running it")
    p.add_argument("--backend", default="cpu", help="the daemon's --backend (default cpu)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of the learner's and actor's tensors")
    p.add_argument("--iters", type=int, default=5, help="learner iterations per check")
    a = p.parse_args()
    prefix = shlex.split(a.rnnd)
    a.daemon = lambda **kw: rnnd.Daemon(binary=prefix, backend=a.backend, input_size=I,
                                        hidden_size=H, layers=L, **kw)
    log("torch %s, device %s, rnnd %s, custom ops %s, daemon %s --backend %s" % (
        torch.__version__, a.device, rnnd.__version__, rnnd.torch.CUSTOM_OPS, a.rnnd, a.backend))
    if not rnnd.torch.CUSTOM_OPS:
        log("FAIL this torch has no torch.library.custom_op (needs torch >= 2.4)")
        return 1
    dev = torch.device(a.device)
    check("learner torch.compile(fullgraph=True), grads=local, vs eager",
          lambda: learner_local(a, dev))
    check("learner torch.compile(fullgraph=True), grads=server over forward_recorded, vs eager",
          lambda: learner_server(a, dev))
    check("actor torch.export of rnnd::step", lambda: actor_export(a, dev))
    failed = [n for n, ok in results if not ok]
    log("%s: %d passed, %d failed" % ("FAIL" if failed else "PASS", len(results) - len(failed),
                                      len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
