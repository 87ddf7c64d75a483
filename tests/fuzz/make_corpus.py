"""Writes the seed corpus of fuzz_request (tests/fuzz/corpus): for every method a few requests,
valid and not, each file being  [method byte][config byte][request message bytes]  as
fuzz_request.c reads it. Method numbers are enum rnnd_method (server/metrics.h); configs 0..3
are those of fuzz_request.c (even: GRU I=4 H=3 L=1; odd: LSTM I=3 H=2 L=2 with extras of 2).

    PYTHONPATH=build/client/python /usr/bin/python3 tests/fuzz/make_corpus.py
"""

import os
import struct

import numpy as np
from rnnd.v1 import health_pb2, rnnd_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))
(GET_MODEL_INFO, STEP, STEP_STREAM, END_EPISODES, FORWARD, BACKWARD, APPLY_GRADIENTS, GET_WEIGHTS,
 SET_WEIGHTS, SAVE_CHECKPOINT, HEALTH_CHECK, HEALTH_WATCH) = range(12)
GRU, LSTM = 0, 1
DIMS = {GRU: (4, 3, 1), LSTM: (3, 2, 2)}  # I, H, L


def tensor(shape, dtype=pb.FLOAT32, fill=0.25):
    t = pb.Tensor(shape=list(shape), dtype=dtype)
    n = int(np.prod(shape))
    if dtype == pb.FLOAT32:
        t.data = np.full(n, fill, np.float32).tobytes()
    elif dtype == pb.BOOL:
        t.data = bytes([1] + [0] * (n - 1))
    else:
        t.data = bytes(8 * n)
    return t


def params(cfg):
    I, H, L = DIMS[cfg]
    G = 4 if cfg == LSTM else 3
    out = []
    for l in range(L):
        width = I if l == 0 else H
        for name, shape in (("weight_ih_l%d" % l, (G * H, width)), ("weight_hh_l%d" % l, (G * H, H)),
                            ("bias_ih_l%d" % l, (G * H,)), ("bias_hh_l%d" % l, (G * H,))):
            out.append(pb.NamedTensor(name=name, tensor=tensor(shape, fill=0.01)))
    return out


def seeds():
    for cfg in (GRU, LSTM):
        I, H, L = DIMS[cfg]
        yield GET_MODEL_INFO, cfg, pb.GetModelInfoRequest()
        yield STEP, cfg, pb.StepRequest(env_ids=[1, 2], obs=tensor((2, I)), is_init=[True, False],
                                        step_index=[7, 9], return_state=True)
        yield STEP_STREAM, cfg, pb.StepRequest(env_ids=[5], obs=tensor((1, I)))
        yield STEP, cfg, pb.StepRequest(env_ids=[1, 1], obs=tensor((2, I)))  # duplicate
        yield STEP, cfg, pb.StepRequest(env_ids=[3], obs=tensor((1, I), fill=float("nan")))
        yield STEP, cfg, pb.StepRequest(env_ids=[3], obs=tensor((1, I)), extras=tensor((1, 2)))
        yield END_EPISODES, cfg, pb.EndEpisodesRequest(env_ids=[1, 2, 3])
        tr = pb.Trajectories(obs=tensor((2, 3, I)), is_init=tensor((2, 3), pb.BOOL),
                             h0=tensor((2, L, H)))
        if cfg == LSTM:
            tr.c0.CopyFrom(tensor((2, L, H)))
        yield FORWARD, cfg, pb.ForwardRequest(trajectories=tr, keep_tape=True)
        stored = pb.Trajectories(obs=tensor((1, 2, I)), hidden=tensor((1, 2, L, H)))
        if cfg == LSTM:
            stored.cell.CopyFrom(tensor((1, 2, L, H)))
        yield FORWARD, cfg, pb.ForwardRequest(trajectories=stored)
        yield FORWARD, cfg, pb.ForwardRequest(recorded=pb.Recorded(env_ids=[1, 2], steps=4))
        yield BACKWARD, cfg, pb.BackwardRequest(tape_id=3, grad_output=tensor((2, 3, H)),
                                                grad_h_n=tensor((2, L, H)), accumulate=True)
        yield APPLY_GRADIENTS, cfg, pb.ApplyGradientsRequest(grads=params(cfg), lr=0.01)
        yield APPLY_GRADIENTS, cfg, pb.ApplyGradientsRequest()
        yield GET_WEIGHTS, cfg, pb.GetWeightsRequest()
        yield SET_WEIGHTS, cfg, pb.SetWeightsRequest(tensors=params(cfg))
        yield SAVE_CHECKPOINT, cfg, pb.SaveCheckpointRequest(path="ckpt-1")
        yield SAVE_CHECKPOINT, cfg, pb.SaveCheckpointRequest(path="../escape")
        yield HEALTH_CHECK, cfg, health_pb2.HealthCheckRequest(service="rnnd.v1.Rnn")
        yield HEALTH_WATCH, cfg, health_pb2.HealthCheckRequest(service="")


def main():
    out = os.path.join(HERE, "corpus")
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        os.remove(os.path.join(out, old))
    for n, (method, cfg, msg) in enumerate(seeds()):
        with open(os.path.join(out, "seed-%02d-m%d-c%d" % (n, method, cfg)), "wb") as f:
            f.write(struct.pack("BB", method, cfg) + msg.SerializeToString())
    print("wrote %d seeds to %s" % (n + 1, out))


if __name__ == "__main__":
    main()
