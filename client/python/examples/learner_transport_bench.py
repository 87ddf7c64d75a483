"""The learner's iteration through each transport: Forward (tape kept) -> loss gradient -> Backward
(accumulated) -> ApplyGradients, with the same shapes through shared memory and through gRPC
bytes, on one daemon. Prints the minimum, median and quartiles of each (ms) and, with
--kernel-ms, the ratio of the minimum to the kernels' own fwd+bwd at that shape (the minimum of
rnnd-kernel-bench --grad-input: on a shared machine the minima are the comparable figures).

    PYTHONPATH=build/client/python /usr/bin/python3 client/python/examples/learner_transport_bench.py \\
        --rnnd build/server/rnnd --batch 256 --steps 64 --input 64 --hidden 128 --repeat 20

With --target the daemon is not started (a "unix:PATH" or loopback target to measure shared
memory).
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

import rnnd


def iteration(c, obs, is_init):
    f = c.forward(obs, is_init, keep_tape=True)
    # d mean(output^2) / d output: the "head and loss" (float32, like the output).
    grad = np.multiply(f.output, np.float32(2.0 / f.output.size))
    c.backward(f.tape_id, grad, accumulate=True)
    c.apply_gradients()


def measure(c, obs, is_init, warmup, repeat):
    for _ in range(warmup):
        iteration(c, obs, is_init)
    ms = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        iteration(c, obs, is_init)
        ms.append((time.perf_counter() - t0) * 1e3)
    return [min(ms)] + list(np.percentile(ms, [25, 50, 75]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rnnd", help="the rnnd binary to start (default $RNND_BIN)")
    ap.add_argument("--target", help="an rnnd already running")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--input", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reset-prob", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--kernel-ms", type=float, help="the kernels' fwd+bwd (ms) to compare with")
    a = ap.parse_args()

    d, tmp = None, None
    target = a.target
    if target is None:
        tmp = tempfile.TemporaryDirectory(prefix="rnnd-bench-")
        sock = "unix:" + os.path.join(tmp.name, "rnnd.sock")
        d = rnnd.Daemon(binary=a.rnnd, input_size=a.input, hidden_size=a.hidden, listen=sock,
                        http="off", tape_memory_mb=4096, max_message_mb=1024, max_reply_mb=2048,
                        optimizer="sgd").start()
        target = sock
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((a.batch, a.steps, a.input)).astype(np.float32)
    is_init = rng.random((a.batch, a.steps)) < a.reset_prob
    print("learner iteration B=%d T=%d I=%d H=%d, %.0f%% resets, target %s"
          % (a.batch, a.steps, a.input, a.hidden, 100 * a.reset_prob, target))
    try:
        for transport in ("shm", "grpc"):
            with rnnd.Client(target, transport=transport, max_message_mb=1024) as c:
                q = measure(c, obs, is_init, a.warmup, a.repeat)
                ratio = " (%.2fx the kernels' %.1f ms)" % (q[0] / a.kernel_ms, a.kernel_ms) \
                    if a.kernel_ms else ""
                print("  %-4s min %8.2f ms  p50 %.2f (p25 %.2f, p75 %.2f)%s"
                      % (c.transport, q[0], q[2], q[1], q[3], ratio))
    finally:
        if d is not None:
            d.stop()
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
