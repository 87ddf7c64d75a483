#!/usr/bin/python3
"""End-to-end recurrent RL through rnnd: actors send observations and get actions from the
daemon, which holds the whole policy (GRU core, policy and value heads); a PyTorch learner trains
it with an actor-critic loss on the heads' outputs.

The task ("cue recall") needs memory: an episode shows one of K cues at its first step only,
then blank observations; at its last step the observation raises a "respond now" flag, and the
action taken there earns reward 1 if it names the cue (0 otherwise). Episode lengths are random,
so episodes end and restart in the middle of rollouts (is_init resets). Without memory the best
policy guesses: success 1/K.

    actors (processes, ──Step(obs, is_init; reward, done of the previous step)──▶ rnnd: GRU core,
      no weights)     ◀───────────── action (sampled by the daemon) ─────────────  policy and
                                                                                  value heads
    learner (PyTorch) ◀── Forward(cursor): logits, values; the recorded actions, ───┤
                          rewards, dones, behaviour log-probs                        │
                      ─── Backward(dL/d logits, dL/d value), ApplyGradients ─────────┘

- Each actor owns a few envs and steps them all with one request per tick over a StepStream,
  through gRPC only (it could run on another host). It sends the observations and, for each
  env's previous step, the reward and done flag; the daemon runs core and heads, draws the
  actions (keyed by seed, env and step, so a retry gets the same one), records each step's
  action, behaviour log-prob and value, and returns the actions.
- The learner takes every env's next window of T recorded steps through the daemon's cursor
  (Forward over `recorded` with `cursor`, and a tape): the current policy's logits and values,
  and the recorded actions, rewards, dones and behaviour log-probs; it keeps no replay and no
  weights of its own. The loss is V-trace actor-critic (IMPALA) in PyTorch on those small
  tensors; dL/d logits and dL/d value go to the daemon's Backward (through heads and core,
  accumulated there) and ApplyGradients takes the daemon's Adam step on every tensor.
- Actors never wait for the learner. The cursor hands out each recorded step once: consecutive
  windows share one step (the bootstrap step, whose reward comes with the next Step), so every
  transition is learnt from at most once; the daemon runs with --max-policy-lag, so steps of
  weights more than that many updates old are skipped (as are steps that left the ring of
  --trajectory-steps before the learner got to them); the progress lines count both.

    ~/rnnd-venv/bin/python client/python/examples/memory_task.py \
        --rnnd build/server/rnnd --png memory_task.png

(~/rnnd-venv: client/python/README.md; or PYTHONPATH=build/client/python /usr/bin/python3.)

Prints progress; writes the learning curve to --png; exits 0 when the success rate reached
--target (default 0.9) within --minutes.
"""

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# The environment (vectorised over the envs of one actor).

class CueRecall:
    def __init__(self, n, k, min_len, max_len, rng):
        self.n, self.k, self.min_len, self.max_len, self.rng = n, k, min_len, max_len, rng
        self.t = np.zeros(n, np.int64)
        self.length = np.zeros(n, np.int64)
        self.cue = np.zeros(n, np.int64)
        for i in range(n):
            self._reset(i)

    def _reset(self, i):
        self.t[i] = 0
        self.length[i] = self.rng.integers(self.min_len, self.max_len + 1)
        self.cue[i] = self.rng.integers(self.k)

    def observe(self):
        """obs [n, K+1] and is_init [n] for the current step of every env."""
        obs = np.zeros((self.n, self.k + 1), np.float32)
        first = self.t == 0
        obs[first, self.cue[first]] = 1.0
        obs[self.t == self.length - 1, self.k] = 1.0
        return obs, first

    def act(self, action):
        """Applies one action per env; returns (reward [n], done [n]) and starts new episodes."""
        last = self.t == self.length - 1
        reward = (last & (action == self.cue)).astype(np.float32)
        self.t += 1
        for i in np.flatnonzero(last):
            self._reset(i)
        return reward, last


# ---------------------------------------------------------------------------------------------
# Actor processes (numpy + rnnd only; no weights).

def actor_main(a, actor_id, env_ids, target, stop, done):
    """Steps its envs until stop is set, reporting (actor, env steps, episode results) on done
    every few ticks; it never waits for the learner."""
    import rnnd
    rng = np.random.default_rng(a.seed * 1000 + actor_id)
    env = CueRecall(len(env_ids), a.cues, a.min_len, a.max_len, rng)
    client = rnnd.Client(target, transport="grpc")  # as from another host
    stepper = client.stepper()
    # What each env's previous step earned, sent with its next Step (0 and false before its
    # first step: the daemon takes only those for an env with no recorded step).
    reward = np.zeros(len(env_ids), np.float32)
    ended = np.zeros(len(env_ids), bool)
    results, ticks = [], 0
    while not stop.is_set():
        obs, is_init = env.observe()
        action = stepper.step_result(env_ids, obs, is_init, reward=reward, done=ended).action
        reward, ended = env.act(action)
        results.extend(reward[ended].tolist())
        ticks += 1
        if ticks % 8 == 0:
            done.put((actor_id, 8 * len(env_ids), results))
            results = []
    stepper.close()
    client.end_episodes(env_ids)
    client.close()


# ---------------------------------------------------------------------------------------------
# The learner.

def vtrace(values, rewards, discounts, rhos, bootstrap):
    """V-trace targets and policy-gradient advantages over [B, T] (IMPALA, rho-bar = c-bar = 1)."""
    import torch
    rho = torch.clamp(rhos, max=1.0)
    v_next = torch.cat([values[:, 1:], bootstrap[:, None]], 1)
    deltas = rho * (rewards + discounts * v_next - values)
    acc = torch.zeros_like(bootstrap)
    vs_minus_v = []
    for t in reversed(range(values.shape[1])):
        acc = deltas[:, t] + discounts[:, t] * rho[:, t] * acc
        vs_minus_v.append(acc)
    vs = values + torch.stack(vs_minus_v[::-1], 1)
    vs_next = torch.cat([vs[:, 1:], bootstrap[:, None]], 1)
    adv = rho * (rewards + discounts * vs_next - values)
    return vs, adv


def learn(a, target, log=print):
    import torch
    import rnnd
    torch.set_num_threads(1)
    K, H, T = a.cues, a.hidden, a.unroll
    client = rnnd.Client(target)
    info = client.info()
    want = ("gru", K + 1, H, K, True)
    have = (info.cell, info.input_size, info.hidden_size, info.discrete_actions, info.value_head)
    if have != want:
        raise SystemExit("the daemon at %s has (cell, input, hidden, discrete actions, value head) "
                         "= %s, this example needs %s" % (target, have, want))
    a.backend = info.backend
    # A near-uniform first policy: the logits' layer starts ten times smaller than nn.Linear's.
    w = client.get_weights()
    w["policy_logits.weight"] = 0.1 * w["policy_logits.weight"]
    w["policy_logits.bias"] = np.zeros_like(w["policy_logits.bias"])
    client.set_weights(w)

    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    stop = ctx.Event()
    actors, all_ids = [], []
    for i in range(a.actors):
        ids = np.arange(a.envs_per_actor, dtype=np.uint64) + np.uint64((a.seed + 1) * 1_000_000 + i * 1000)
        all_ids.extend(ids.tolist())
        p = ctx.Process(target=actor_main, args=(a, i, ids, target, stop, done), daemon=True)
        p.start()
        actors.append(p)

    window = []  # episode results since the last report
    reported = set()  # actors that reported (their envs have recorded steps)
    steps = 0  # env steps the actors took

    def collect():
        """Takes what the actors reported."""
        nonlocal steps
        while True:
            try:
                i, n, r = done.get_nowait()
            except Exception:
                return
            reported.add(i)
            steps += n
            window.extend(r)

    def next_windows():
        """Every env's next cursor window of T steps, waiting until each has them."""
        while True:
            if len(reported) == len(actors):
                try:
                    return client.forward_recorded(all_ids, T, keep_tape=True, cursor=True,
                                                   fields=("action", "reward"))
                except rnnd.RnndError as e:
                    if (e.code_name != "FAILED_PRECONDITION"
                            or "new recorded steps" not in e.details):
                        raise
            dead = [p for p in actors if not p.is_alive()]
            if dead:
                raise SystemExit("an actor process died (exit code %s)" % dead[0].exitcode)
            time.sleep(0.005)
            collect()

    curve = []  # (seconds, env steps, episodes, success over the last report)
    start = time.monotonic()
    episodes = updates = trained = lagged = overwritten = 0
    last_report = start
    reached = None
    try:
        while True:
            elapsed = time.monotonic() - start
            if elapsed > a.minutes * 60:
                break
            # Step t's reward and done come with the env's step t+1: the window's last step is
            # the bootstrap, and the next window starts there (each transition learnt once).
            f = next_windows()
            trained += (T - 1) * len(all_ids)
            lagged += int(f.cursor_lagged.sum())
            overwritten += int(f.cursor_overwritten.sum())

            logits_all = torch.from_numpy(np.array(f.logits)).requires_grad_()  # [B, T, K]
            v = torch.from_numpy(np.array(f.head_value)).requires_grad_()  # [B, T]
            actions = torch.from_numpy(np.array(f.action[:, :-1]))
            rewards = torch.from_numpy(np.array(f.reward[:, :-1]))
            blogp = torch.from_numpy(np.array(f.log_prob[:, :-1]))
            discounts = a.gamma * torch.from_numpy(~np.array(f.done[:, :-1])).float()

            logp_all = torch.log_softmax(logits_all[:, :-1], -1)
            logp = logp_all.gather(-1, actions[..., None])[..., 0]
            with torch.no_grad():
                vs, adv = vtrace(v[:, :-1], rewards, discounts, torch.exp(logp - blogp), v[:, -1])
            pg_loss = -(adv * logp).mean()
            v_loss = 0.5 * ((vs - v[:, :-1]) ** 2).mean()
            entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
            loss = pg_loss + a.value_coef * v_loss - a.entropy_coef * entropy
            loss.backward()  # dL/d logits, dL/d value: K + 1 floats per step

            # Heads, core: the daemon's Backward accumulates every weight's gradient, its
            # ApplyGradients clips them (--max-grad-norm) and takes the Adam step.
            client.backward(f.tape_id, grad_logits=logits_all.grad.numpy(),
                            grad_head_value=v.grad.numpy(), accumulate=True, input_grads=())
            client.apply_gradients()
            updates += 1

            collect()
            now = time.monotonic()
            if now - last_report >= a.report_s and len(window) >= 50:
                rate = float(np.mean(window))
                episodes += len(window)
                curve.append((now - start, steps, episodes, rate))
                log("%6.1fs  updates %5d  env steps %8d (learnt %8d, skipped: lag %6d, ring "
                    "%6d)  episodes %7d  success %5.1f%%  entropy %.2f  value loss %.4f"
                    % (now - start, updates, steps, trained, lagged, overwritten, episodes,
                       100 * rate, float(entropy), float(v_loss)))
                window.clear()
                last_report = now
                if rate >= a.target and reached is None:
                    reached = now - start
                    log("reached %.0f%% success after %.1fs (%d env steps, %d updates)"
                        % (100 * a.target, reached, steps, updates))
                    if a.stop_at_target:
                        break
    finally:
        stop.set()
        for p in actors:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        client.close()
    return curve, reached


def plot(curve, a, path, reached):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [c[0] for c in curve]
    s = [100 * c[3] for c in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, s, label="success rate")
    ax.axhline(100.0 / a.cues, color="gray", ls="--", label="chance (1/%d)" % a.cues)
    ax.axhline(100 * a.target, color="green", ls=":", label="target")
    if reached is not None:
        ax.axvline(reached, color="green", alpha=0.3)
    ax.set_xlabel("seconds (%s backend, %d actors x %d envs)" % (a.backend, a.actors, a.envs_per_actor))
    ax.set_ylabel("success %")
    ax.set_ylim(0, 100)
    ax.set_title("rnnd: cue recall, episodes of %d-%d steps, GRU %d" % (a.min_len, a.max_len, a.hidden))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rnnd", default=os.environ.get("RNND_BIN"),
                    help="rnnd binary to start (default $RNND_BIN)")
    ap.add_argument("--target-addr", help="use a running daemon at HOST:PORT instead (started "
                    "with --cell gru --input-size K+1 --hidden-size H --discrete-actions K "
                    "--value-head 1 --trajectory-steps 2T or more, best with --max-policy-lag)")
    ap.add_argument("--minutes", type=float, default=5.0, help="time budget")
    ap.add_argument("--target", type=float, default=0.9, help="success rate to reach")
    ap.add_argument("--stop-at-target", action="store_true", help="stop once --target is reached")
    ap.add_argument("--png", default="memory_task.png", help="learning curve ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--actors", type=int, default=3)
    ap.add_argument("--envs-per-actor", type=int, default=32)
    ap.add_argument("--cues", type=int, default=8, help="K: chance is 1/K")
    ap.add_argument("--min-len", type=int, default=4, help="shortest episode")
    ap.add_argument("--max-len", type=int, default=20, help="longest episode")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--unroll", type=int, default=32, help="T: steps per learner window")
    ap.add_argument("--max-policy-lag", type=int, default=2, help="the daemon's: steps of "
                    "weights more updates old than this are not learnt from")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=0.97)
    ap.add_argument("--entropy-coef", type=float, default=0.01)
    ap.add_argument("--value-coef", type=float, default=0.5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--report-s", type=float, default=2.0, help="seconds between progress lines")
    ap.add_argument("--backend", default="cpu", help="backend of the daemon it starts (cpu, cuda, auto)")
    ap.add_argument("--echo-daemon", action="store_true", help="show the daemon's log")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    try:
        import rnnd
    except ImportError as e:
        raise SystemExit("cannot import rnnd (%s): pip install ./client/python (see its README), "
                         "or build and set PYTHONPATH=<build>/client/python" % e)
    d = None
    target = a.target_addr
    if target is None:
        binary = a.rnnd
        if binary and binary.endswith(".py"):
            binary = [sys.executable, binary]
        d = rnnd.Daemon(binary=binary, backend=a.backend, echo=sys.stderr if a.echo_daemon else None,
                        cell="gru", layers=1, input_size=a.cues + 1, hidden_size=a.hidden,
                        discrete_actions=a.cues, value_head=1,
                        trajectory_steps=4 * a.unroll, max_policy_lag=a.max_policy_lag, lr=a.lr,
                        max_grad_norm=a.max_grad_norm, seed=a.seed,
                        max_envs=max(1024, 2 * a.actors * a.envs_per_actor))
        d.start()
        target = d.target
        print("rnnd ready at %s (%s)" % (target, " ".join(map(str, d.argv()))), flush=True)
    try:
        print("cue recall: K=%d cues (chance %.0f%%), episodes of %d-%d steps, %d actors x %d envs, "
              "window T=%d" % (a.cues, 100.0 / a.cues, a.min_len, a.max_len, a.actors,
                               a.envs_per_actor, a.unroll), flush=True)
        curve, reached = learn(a, target, log=lambda s: print(s, flush=True))
    finally:
        if d is not None:
            d.stop()
    if a.png and curve:
        plot(curve, a, a.png, reached)
        print("learning curve: %s" % a.png)
    final = curve[-1][3] if curve else 0.0
    print("final success %.1f%%; %s" % (100 * final, "target reached after %.1fs" % reached
                                        if reached is not None else "target not reached"))
    return curve, reached


if __name__ == "__main__":
    _, reached = main()
    sys.exit(0 if reached is not None else 1)
