"""A pure-Python stand-in for the rnnd daemon (grpcio server + PyTorch math), written from
DESIGN.md §2-§3. It exists to develop and debug the Python client and the example without the C
daemon; the CTest tests run against the real daemon, never against this.

    PYTHONPATH=<build>/client/python /usr/bin/python3 fake_rnnd.py --cell gru --input-size 4 \
        --hidden-size 8 --layers 2 --extras-size 3
prints "rnnd ready grpc=127.0.0.1:PORT http=none backend=fake" like the daemon.
"""

import argparse
import itertools
import threading
from concurrent import futures

import grpc
import numpy as np
import torch

from rnnd._tensor import decode, encode
from rnnd.v1 import health_pb2, health_pb2_grpc
from rnnd.v1 import rnnd_pb2 as pb
from rnnd.v1 import rnnd_pb2_grpc


def abort(ctx, code, msg):
    ctx.abort(code, msg)


class Fake(rnnd_pb2_grpc.RnnServicer):
    def __init__(self, a):
        self.a = a
        torch.manual_seed(a.seed)
        mod = (torch.nn.LSTM if a.cell == "lstm" else torch.nn.GRU)(a.input_size, a.hidden_size, a.layers)
        self.params = {k: v.detach().clone() for k, v in mod.state_dict().items()}
        self.names = list(self.params)
        self.opt_state = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in self.params.items()}
        self.opt_t = 0
        self.acc = None
        self.version = 0
        self.envs = {}  # id -> dict(h, c, last_index, last_out, rec list)
        self.tapes = {}
        self.tape_ids = itertools.count(1)
        self.lock = threading.Lock()

    # -- math --
    def cell_step(self, p, x, h, c, l):
        wi, wh, bi, bh = (p[f"{k}_l{l}"] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        gi = x @ wi.T + bi
        gh = h @ wh.T + bh
        H = self.a.hidden_size
        if self.a.cell == "gru":
            r = torch.sigmoid(gi[:, :H] + gh[:, :H])
            z = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
            n = torch.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
            return (1 - z) * n + z * h, None
        g = gi + gh
        i, f, gg, o = (g[:, k * H:(k + 1) * H] for k in range(4))
        c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        return torch.sigmoid(o) * torch.tanh(c2), c2

    def layers_step(self, p, x, h, c):
        # h, c: [B, L, H]
        hs, cs = [], []
        inp = x
        for l in range(self.a.layers):
            hl, cl = self.cell_step(p, inp, h[:, l], c[:, l] if c is not None else None, l)
            hs.append(hl)
            cs.append(cl)
            inp = hl
        return inp, torch.stack(hs, 1), (torch.stack(cs, 1) if c is not None else None)

    def seq(self, p, obs, is_init, h0, c0, hidden, cell):
        B, T, _ = obs.shape
        L, H = self.a.layers, self.a.hidden_size
        lstm = self.a.cell == "lstm"
        zeros = torch.zeros(B, L, H)
        if hidden is not None:
            h = hidden[:, 0]
            c = cell[:, 0] if (lstm and cell is not None) else (zeros if lstm else None)
        else:
            h = h0 if h0 is not None else zeros
            c = (c0 if c0 is not None else zeros) if lstm else None
        outs = []
        for t in range(T):
            m = is_init[:, t].view(B, 1, 1)
            rh = hidden[:, t] if hidden is not None else zeros
            h = torch.where(m, rh, h)
            if lstm:
                rc = cell[:, t] if cell is not None else zeros
                c = torch.where(m, rc, c)
            o, h, c = self.layers_step(p, obs[:, t], h, c)
            outs.append(o)
        return torch.stack(outs, 1), h, c

    # -- RPCs --
    def GetModelInfo(self, req, ctx):
        return pb.ModelInfo(cell=self.a.cell, input_size=self.a.input_size, hidden_size=self.a.hidden_size,
                            num_layers=self.a.layers, compute="fp32", backend="fake", device="python",
                            model_version=self.version, envs_active=len(self.envs), max_batch=256,
                            extras_size=self.a.extras_size)

    def Step(self, req, ctx):
        with self.lock:
            return self._step(req, ctx)

    def StepStream(self, it, ctx):
        for req in it:
            with self.lock:
                yield self._step(req, ctx)

    def _step(self, req, ctx):
        ids = list(req.env_ids)
        B = len(ids)
        if len(set(ids)) != B:
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, "duplicate env id")
        obs = decode(req.obs)
        if obs is None or obs.shape != (B, self.a.input_size):
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, "obs must be [B, I]")
        init = list(req.is_init) or [False] * B
        ex = decode(req.extras) if req.HasField("extras") else None
        if ex is not None and (self.a.extras_size == 0 or ex.shape != (B, self.a.extras_size)):
            abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, "extras [B, E]; set --extras-size")
        L, H = self.a.layers, self.a.hidden_size
        lstm = self.a.cell == "lstm"
        for i, e in enumerate(ids):
            if not init[i] and e not in self.envs:
                abort(ctx, grpc.StatusCode.FAILED_PRECONDITION, f"env {e} has no state; send is_init")
        h = torch.stack([torch.zeros(L, H) if init[i] else self.envs[e]["h"] for i, e in enumerate(ids)])
        c = torch.stack([torch.zeros(L, H) if init[i] else self.envs[e]["c"] for i, e in enumerate(ids)]) if lstm else None
        with torch.no_grad():
            out, h2, c2 = self.layers_step(self.params, torch.from_numpy(obs.copy()), h, c)
        for i, e in enumerate(ids):
            st = self.envs.setdefault(e, {"rec": []})
            st["rec"].append(dict(obs=obs[i].copy(), init=bool(init[i]),
                                  extras=ex[i].copy() if ex is not None else np.zeros(self.a.extras_size, np.float32),
                                  h=(st.get("h") if st.get("h") is not None else torch.zeros(L, H)),
                                  c=(st.get("c") if st.get("c") is not None else torch.zeros(L, H)),
                                  v=self.version))
            st["rec"] = st["rec"][-self.a.trajectory_steps:]
            st["h"] = h2[i]
            st["c"] = c2[i] if lstm else None
        r = pb.StepReply(model_version=self.version)
        encode(out.numpy(), out=r.output)
        if req.return_state:
            encode(h2.numpy(), out=r.h)
            if lstm:
                encode(c2.numpy(), out=r.c)
        return r

    def EndEpisodes(self, req, ctx):
        with self.lock:
            n = sum(1 for e in req.env_ids if self.envs.pop(e, None) is not None)
        return pb.EndEpisodesReply(released=n)

    def Forward(self, req, ctx):
        with self.lock:
            lstm = self.a.cell == "lstm"
            rep = pb.ForwardReply(model_version=self.version)
            t = lambda a: None if a is None else torch.from_numpy(np.array(a))  # noqa: E731
            if req.WhichOneof("source") == "recorded":
                ids, T = list(req.recorded.env_ids), req.recorded.steps
                for e in ids:
                    n = len(self.envs.get(e, {"rec": []})["rec"])
                    if n < T:
                        abort(ctx, grpc.StatusCode.FAILED_PRECONDITION, f"env {e} has {n} recorded steps, asked {T}")
                recs = [self.envs[e]["rec"][-T:] for e in ids]
                obs = torch.tensor(np.array([[s["obs"] for s in r] for r in recs]))
                init = torch.tensor([[s["init"] for s in r] for r in recs])
                h0 = torch.stack([r[0]["h"] for r in recs])
                c0 = torch.stack([r[0]["c"] for r in recs]) if lstm else None
                hidden = cell = None
                encode(obs.numpy(), out=rep.obs)
                encode(init.numpy(), out=rep.is_init)
                encode(np.array([[s["extras"] for s in r] for r in recs], np.float32).reshape(len(ids), T, -1), out=rep.extras)
                encode(np.array([[s["v"] for s in r] for r in recs], np.int64), out=rep.step_model_version)
                leaves = {}
            else:
                tr = req.trajectories
                obs = t(decode(tr.obs))
                init = t(decode(tr.is_init)).bool()
                g = lambda n: t(decode(getattr(tr, n))) if tr.HasField(n) else None  # noqa: E731
                h0, c0, hidden, cell = g("h0"), g("c0"), g("hidden"), g("cell")
                leaves = {"obs": obs, "h0": h0, "c0": c0, "hidden": hidden, "cell": cell}
                leaves = {k: v.requires_grad_() for k, v in leaves.items() if v is not None}
                obs, h0, c0, hidden, cell = (leaves.get(k, v) for k, v in
                                             (("obs", obs), ("h0", h0), ("c0", c0), ("hidden", hidden), ("cell", cell)))
            p = {k: v.clone().requires_grad_() for k, v in self.params.items()}
            with torch.enable_grad():
                out, hn, cn = self.seq(p, obs, init, h0, c0, hidden, cell)
            encode(out.detach().numpy(), out=rep.output)
            encode(hn.detach().numpy(), out=rep.h_n)
            if lstm:
                encode(cn.detach().numpy(), out=rep.c_n)
            if req.keep_tape:
                tid = next(self.tape_ids)
                self.tapes[tid] = (p, leaves, out, hn, cn)
                rep.tape_id = tid
            return rep

    def Backward(self, req, ctx):
        with self.lock:
            tape = self.tapes.pop(req.tape_id, None)
            if tape is None:
                abort(ctx, grpc.StatusCode.NOT_FOUND, f"tape {req.tape_id} unknown or expired")
            p, leaves, out, hn, cn = tape
            outs, gos = [out], [torch.from_numpy(decode(req.grad_output).copy())]
            if req.HasField("grad_h_n"):
                outs.append(hn)
                gos.append(torch.from_numpy(decode(req.grad_h_n).copy()))
            if req.HasField("grad_c_n") and cn is not None:
                outs.append(cn)
                gos.append(torch.from_numpy(decode(req.grad_c_n).copy()))
            wrt = list(p.values()) + list(leaves.values())
            gs = torch.autograd.grad(outs, wrt, gos, allow_unused=True)
            gs = [torch.zeros_like(w) if g is None else g for g, w in zip(gs, wrt)]
            gp = dict(zip(p.keys(), gs[:len(p)]))
            gl = dict(zip(leaves.keys(), gs[len(p):]))
            rep = pb.BackwardReply()
            if req.accumulate:
                if self.acc is None:
                    self.acc = {k: torch.zeros_like(v) for k, v in self.params.items()}
                for k in gp:
                    self.acc[k] += gp[k]
            else:
                for k in self.names:
                    rep.grads.append(pb.NamedTensor(name=k, tensor=encode(gp[k].numpy())))
            for k, f in (("obs", "grad_obs"), ("h0", "grad_h0"), ("c0", "grad_c0"),
                         ("hidden", "grad_hidden"), ("cell", "grad_cell")):
                if k in gl:
                    encode(gl[k].numpy(), out=getattr(rep, f))
            return rep

    def ApplyGradients(self, req, ctx):
        with self.lock:
            if len(req.grads):
                grads = {nt.name: torch.from_numpy(decode(nt.tensor).copy()) for nt in req.grads}
            else:
                grads, self.acc = self.acc or {}, None
            lr = req.lr if req.HasField("lr") else self.a.lr
            if self.a.max_grad_norm > 0 and grads:
                norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
                if norm > self.a.max_grad_norm:
                    grads = {k: g * (self.a.max_grad_norm / norm) for k, g in grads.items()}
            self.opt_t += 1
            b1, b2, eps = 0.9, 0.999, 1e-8
            for k, g in grads.items():
                m, v = self.opt_state[k]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                mh = m / (1 - b1 ** self.opt_t)
                vh = v / (1 - b2 ** self.opt_t)
                self.params[k] = self.params[k] - lr * mh / (vh.sqrt() + eps)
            self.version += 1
            return pb.ApplyGradientsReply(model_version=self.version)

    def GetWeights(self, req, ctx):
        with self.lock:
            return pb.Weights(tensors=[pb.NamedTensor(name=k, tensor=encode(v.numpy())) for k, v in self.params.items()],
                              model_version=self.version)

    def SetWeights(self, req, ctx):
        with self.lock:
            for nt in req.tensors:
                a = decode(nt.tensor)
                if nt.name not in self.params or tuple(self.params[nt.name].shape) != a.shape:
                    abort(ctx, grpc.StatusCode.INVALID_ARGUMENT, f"bad tensor {nt.name}")
                self.params[nt.name] = torch.from_numpy(a.copy())
            self.version += 1
            return pb.SetWeightsReply(model_version=self.version)

    def SaveCheckpoint(self, req, ctx):
        return pb.SaveCheckpointReply(path=req.path or "/nonexistent", model_version=self.version)


class Health(health_pb2_grpc.HealthServicer):
    def Check(self, req, ctx):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="gru")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--extras-size", type=int, default=0)
    ap.add_argument("--trajectory-steps", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-grad-norm", type=float, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--listen", default="127.0.0.1:0")
    a, _ = ap.parse_known_args()
    torch.set_num_threads(1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    rnnd_pb2_grpc.add_RnnServicer_to_server(Fake(a), server)
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port(a.listen)
    server.start()
    print(f"rnnd ready grpc=127.0.0.1:{port} http=none backend=fake", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
