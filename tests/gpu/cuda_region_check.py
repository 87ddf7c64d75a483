#!/usr/bin/env python3
"""CUDA regions on a GPU host (docs/design.md "CUDA regions"): a learner's CUDA tensors in place
against rnnd --backend cuda, checked against the same calls through gRPC.

    RNND_BIN=.../rnnd PYTHONPATH=.../site python3 tests/gpu/cuda_region_check.py

1. Forward(recorded) written by the daemon's GPU into the client's region equals the bytes
   path bit for bit (fp32 and bf16 replies; outputs, h_n, the recorded is_init and versions);
   Backward's weight gradients from gradients read in place equal those sent as bytes; a
   Backward with apply through the region (answered before its update is done: async replies)
   leaves the weights a twin daemon has after the same call as bytes, as the next call sees.
2. Bad input changes nothing: a NaN in a gradient in the region is INVALID_ARGUMENT naming the
   element, and the same tape then runs; a span outside the region, a released region and a
   CUDA region where the daemon may not take one (Step) are refused.
3. A client process that exits has its region closed (rnnd_shm_regions falls back).
4. Against a daemon that opens no CUDA region, CUDA tensors go through its socket region.
Exits 1 on the first failure.
"""

import os
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import torch

import rnnd
import rnnd.torch  # noqa: F401 - the ops the fallback path uses
from rnnd.v1 import rnnd_pb2 as pb

I, H, B, T = 16, 64, 96, 12


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def refused(fn, code, text, what):
    """fn() raises an RnndError of code whose details hold text."""
    try:
        fn()
    except rnnd.RnndError as e:
        check(e.code == code and text in e.details, "%s: %s (%s)" % (what, code.name, e.details))
        return
    check(False, what + " is refused")


def span(t, region, offset, shape):
    """Tensor t as an fp32 span of region at offset."""
    t.shape[:] = shape
    t.dtype = pb.FLOAT32
    t.region.region = region
    t.region.offset = offset
    t.region.nbytes = 4 * int(np.prod(shape))


def regions(http):
    with urllib.request.urlopen("http://%s/metrics" % http, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("rnnd_shm_regions "):
                return float(line.split()[1])
    return None


def main():
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    d, twin = (rnnd.Daemon(backend="cuda", input_size=I, hidden_size=H, layers=2, cell="gru",
                           trajectory_steps=T, seed=5).start() for _ in range(2))
    try:
        g = d.client(transport="grpc")
        c = d.client()
        ct = twin.client()
        ids = np.arange(B, dtype=np.uint64)
        for t in range(T + 3):
            x = rng.standard_normal((B, I)).astype(np.float32)
            init = (rng.random(B) < 0.1) | (t == 0)
            g.step(ids, x, is_init=init)
            ct.step(ids, x, is_init=init)
        check(g.transport == "grpc", "bytes client on gRPC")

        # 1. Equal bit for bit.
        for wire in ("float32", "bfloat16"):
            fb = g.forward_recorded(ids, T, keep_tape=True, reply_dtype=wire,
                                    fields=("is_init", "step_model_version"))
            fc = c.forward_recorded(ids, T, keep_tape=True, reply_dtype=wire,
                                    fields=("is_init", "step_model_version"), device=dev)
            check(c.transport == "cuda", "client on the CUDA path (%s)" % wire)
            check(isinstance(fc.output, torch.Tensor) and fc.output.is_cuda,
                  "output is a CUDA tensor (%s)" % wire)
            for name in ("output", "h_n"):
                a = torch.as_tensor(np.asarray(getattr(fb, name), dtype=np.float32))
                bb = getattr(fc, name).cpu()
                check(torch.equal(a, bb), "Forward %s equal to the bytes path (%s)" % (name, wire))
            check(np.array_equal(np.asarray(fb.is_init), fc.is_init.cpu().numpy()),
                  "recorded is_init equal (%s)" % wire)
            go = torch.randn(B, T, H, device=dev)
            gn = torch.randn(B, 2, H, device=dev)
            wb = g.backward(fb.tape_id, rnnd.torch._wire(go, wire), rnnd.torch._wire(gn, wire),
                            dtype=wire, input_grads=())
            wc = c.backward(fc.tape_id, go, gn, dtype=wire, input_grads=())
            same = all(torch.equal(torch.as_tensor(np.asarray(wb.grads[k], dtype=np.float32)),
                                   wc.grads[k].float().cpu()) for k in wb.grads)
            check(same and len(wb.grads) == 8, "Backward weight gradients equal (%s)" % wire)

        # Gradients read in place at an offset the kernels' vector loads cannot take (4 past a
        # multiple of 64): the same weight gradients as bytes.
        go = torch.randn(B, T, H, device=dev)
        fb = g.forward_recorded(ids, T, keep_tape=True, fields=())
        wb = g.backward(fb.tape_id, go.cpu().numpy(), input_grads=())
        fc = c.forward_recorded(ids, T, keep_tape=True, fields=(), device=dev)
        region = c._regions[torch.cuda.current_device()]
        call = region.call(4 * B * T * H + 128)
        off = call.off + 4
        region.mem[off:off + 4 * B * T * H].view(torch.float32).copy_(go.flatten())
        torch.cuda.synchronize()
        req = pb.BackwardRequest(tape_id=fc.tape_id, input_grads=0)
        span(req.grad_output, region.id, off, [B, T, H])
        wm = c._call("Backward", req)
        call.close()
        got = {nt.name: np.asarray(rnnd.client.decode(nt.tensor)) for nt in wm.grads}
        check(len(got) == 8 and all(np.array_equal(np.asarray(wb.grads[k]), got[k]) for k in got),
              "Backward from gradients at a 4-byte offset equal to the bytes path's")

        check(ct.forward_recorded(ids, 1, device=dev) is not None and
              ct._regions[torch.cuda.current_device()].event is not None,
              "the region has the daemon's event (async replies)")
        v0 = g.get_weights().model_version
        go = torch.randn(B, T, H, device=dev)
        fb = g.forward_recorded(ids, T, keep_tape=True, fields=())
        rb = g.backward(fb.tape_id, go.cpu().numpy(), accumulate=True, apply=True,
                        input_grads=())
        ft = ct.forward_recorded(ids, T, keep_tape=True, fields=(), device=dev)
        rt = ct.backward(ft.tape_id, go, accumulate=True, apply=True, input_grads=())
        wb, wt = g.get_weights(), ct.get_weights()
        check(rb.model_version == rt.model_version == wt.model_version == v0 + 1,
              "Backward with apply: one update each (version %d)" % rt.model_version)
        check(all(np.array_equal(wb[k], wt[k]) for k in wb),
              "Backward with apply through the region: the weights equal the bytes path's")

        # 2. Bad input changes nothing.
        f = c.forward_recorded(ids, T, keep_tape=True, device=dev)
        bad = torch.randn(B, T, H, device=dev)
        bad[3, 4, 5] = float("nan")
        refused(lambda: c.backward(f.tape_id, bad, accumulate=True, input_grads=()),
                grpc.StatusCode.INVALID_ARGUMENT, "element %d is NaN" % (3 * T * H + 4 * H + 5),
                "a NaN in the region, named by element")
        w0 = g.get_weights()
        r = c.backward(f.tape_id, torch.randn(B, T, H, device=dev), input_grads=())
        check(len(r.grads) == 8, "the tape runs after the refusal")
        check(all(np.array_equal(w0[k], v) for k, v in g.get_weights().items()),
              "weights unchanged")
        region = c._regions[torch.cuda.current_device()]
        call = region.call(1 << 10)
        req = pb.BackwardRequest(tape_id=f.tape_id)
        span(req.grad_output, region.id, region.size - 64, [B, T, H])
        refused(lambda: c._call("Backward", req), grpc.StatusCode.INVALID_ARGUMENT, "outside",
                "a span outside the region")
        sreq = pb.StepRequest(env_ids=[1])
        span(sreq.obs, region.id, 64, [1, I])
        refused(lambda: c._call("Step", sreq), grpc.StatusCode.INVALID_ARGUMENT, "CUDA region",
                "Step from a CUDA region")
        call.close()

        # 3. A client that exits has its region closed.
        n0 = regions(d.http)
        child = subprocess.run([sys.executable, "-c", (
            "import torch, rnnd, rnnd.torch, numpy as np\n"
            "c = rnnd.Client(%r)\n"
            "f = c.forward_recorded(np.arange(4, dtype=np.uint64), 2, device=torch.device('cuda'))\n"
            "assert c.transport == 'cuda'\n"
            "import os; os._exit(0)\n") % d.target], timeout=120)
        check(child.returncode == 0, "a child process registered a region")
        for _ in range(40):
            if regions(d.http) == n0:
                break
            time.sleep(0.5)
        check(regions(d.http) == n0, "its region closed after it exited (%s -> %s)"
              % (n0, regions(d.http)))
        rid = region.id
        c.close()
        span(req.grad_output, rid, 64, [B, T, H])
        with d.client(transport="grpc") as g2:
            refused(lambda: g2._call("Backward", req), grpc.StatusCode.FAILED_PRECONDITION,
                    "not registered", "a released region")
        g.close()
        ct.close()
    finally:
        d.stop()
        twin.stop()

    # 4. A daemon that opens no CUDA region (here on the CPU; likewise one on several devices):
    # CUDA tensors go through its socket region, with the bytes path's results, on the GPU.
    with rnnd.Daemon(backend="cpu", input_size=I, hidden_size=H, trajectory_steps=T,
                     seed=5) as cd, cd.client() as c, cd.client(transport="grpc") as g:
        ids = np.arange(8, dtype=np.uint64)
        for t in range(T):
            g.step(ids, rng.standard_normal((8, I)).astype(np.float32), is_init=t == 0)
        fb = g.forward_recorded(ids, T, fields=())
        fc = c.forward_recorded(ids, T, fields=(), device=dev)
        check(c.transport == "socket", "CUDA tensors through the socket region (%s)" % c.transport)
        check(fc.output.is_cuda and torch.equal(fc.output.cpu(), torch.from_numpy(fb.output)),
              "its output on the GPU, equal to the bytes path's")
    print("cuda_region_check: all passed")


if __name__ == "__main__":
    main()
