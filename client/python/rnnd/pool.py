"""rnnd.Pool: one client over several rnnd instances, each env placed on one of them.

    pool = rnnd.Pool(["rnnd-0.rnnd:50051", "rnnd-1.rnnd:50051"])
    out = pool.step(env_ids, obs, is_init)       # rows split by instance, replies in row order

Placement is rendezvous (highest-random-weight) hashing of the env id over the target strings:
every target scores the env and the highest score wins. It depends only on the env id and the
set of target strings (not their order), so every actor and learner given the same strings
agrees on where an env's state lives, and adding an instance moves only the envs it now wins
(about 1/(n+1) of them). A moved env has no state on its new instance, so its next step must
carry is_init: grow a pool between episodes where that matters.

The hash is shared with the C client (client/include/rnnd_client_pool.h), bit for bit:
    target_hash(name) = FNV-1a 64 of the name's UTF-8 bytes
    mix64(z)          = splitmix64 finalizer
    weight(env, th)   = mix64(th ^ mix64(env + 0x9e3779b97f4a7c15))      (mod 2**64)
    pick(env)         = the target of highest weight; ties go to the smaller target hash.
"""

import grpc
import numpy as np

from .client import (Client, RnndError, StepResult, _SendRecv, _step_request, _step_result,
                     _ids)

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def target_hash(name):
    """FNV-1a 64 of the target string's UTF-8 bytes (an int)."""
    h = _FNV_OFFSET
    for b in name.encode("utf-8"):
        h = ((h ^ b) * _FNV_PRIME) & _M64
    return h


def _mix64(z):
    # numpy uint64 arithmetic wraps mod 2**64, as C's does.
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


def weights(env_ids, target_hashes):
    """Scores [B, n] (uint64) of each env on each target hash."""
    e = np.asarray(env_ids, dtype=np.uint64).reshape(-1)
    th = np.asarray([int(h) for h in target_hashes], dtype=np.uint64)
    with np.errstate(over="ignore"):
        m = _mix64(e + _GOLDEN)
        return _mix64(m[:, None] ^ th[None, :])


def pick(env_ids, targets):
    """Index into targets (strings) of the target that holds each env id: an int array [B]."""
    hashes = [target_hash(t) for t in targets]
    if not hashes:
        raise ValueError("no targets")
    # Targets sorted by hash: argmax takes the first maximum, i.e. the smaller hash on a tie.
    order = np.argsort(np.asarray(hashes, dtype=np.uint64), kind="stable")
    w = weights(env_ids, [hashes[i] for i in order])
    return order[np.argmax(w, axis=1)] if w.shape[0] else np.zeros(0, dtype=np.int64)


class Pool:
    """Clients to several rnnd instances (one per target string) with env placement by
    rendezvous hashing. Keyword arguments go to each Client (token, tls, timeout, ...).

    ``step``/``step_result``/``end_episodes``/``stepper`` split by env; ``clients[i]`` reaches one
    instance for everything else (info, weights, learner calls). ``set_weights`` sends to all.
    """

    def __init__(self, targets, **client_kw):
        targets = list(targets)
        if not targets:
            raise ValueError("a Pool needs at least one target")
        if len(set(targets)) != len(targets):
            raise ValueError("a target is given twice: %r" % (targets,))
        self.targets = targets
        self.clients = [Client(t, **client_kw) for t in targets]
        self._hashes = [target_hash(t) for t in targets]
        self._order = np.argsort(np.asarray(self._hashes, dtype=np.uint64), kind="stable")
        self._sorted = [self._hashes[i] for i in self._order]

    def __len__(self):
        return len(self.clients)

    def close(self):
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=30.0):
        for c in self.clients:
            c.wait_ready(timeout)

    def pick(self, env_ids):
        """Target index of each env id (an int array [B])."""
        w = weights(env_ids, self._sorted)
        if w.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return self._order[np.argmax(w, axis=1)]

    def split(self, env_ids):
        """[(target index, row indices)] for the targets that hold some of env_ids, in target
        order; the rows of each keep their order in env_ids."""
        tgt = self.pick(env_ids)
        return [(t, np.flatnonzero(tgt == t)) for t in range(len(self.clients))
                if np.any(tgt == t)]

    # -- calls split by env ------------------------------------------------------------------------

    def _parts(self, env_ids, obs, is_init, step_index, extras, return_state, policy):
        """(B, [(target, rows, step arguments of those rows, policy options of those rows)]).
        policy: greedy, return_logits, return_core (the same for every part) and reward, done,
        truncated (per row)."""
        ids = np.asarray(_ids(env_ids), dtype=np.uint64)
        B = ids.shape[0]
        obs = np.asarray(obs)
        if obs.shape[:1] != (B,):
            raise ValueError("obs has shape %s but there are %d env ids" % (obs.shape, B))
        if is_init is not None:
            flags = np.asarray(is_init, dtype=bool)
            is_init = np.full(B, bool(flags)) if flags.ndim == 0 else flags.reshape(-1)
            if is_init.shape != (B,):
                raise ValueError("is_init has %d flags for %d env ids" % (is_init.size, B))
        if step_index is not None:
            step_index = np.asarray(step_index, dtype=np.uint64).reshape(-1)
            if step_index.shape != (B,):
                raise ValueError("step_index has %d values for %d env ids"
                                 % (step_index.size, B))
        if extras is not None:
            extras = np.asarray(extras)
            if extras.shape[:1] != (B,):
                raise ValueError("extras has shape %s but there are %d env ids"
                                 % (extras.shape, B))
        per_row = {k: np.broadcast_to(np.asarray(policy[k]), (B,))
                   for k in ("reward", "done", "truncated") if policy.get(k) is not None}
        parts = []
        for t, rows in self.split(ids):
            kw = dict(policy, **{k: v[rows] for k, v in per_row.items()})
            parts.append((t, rows, (ids[rows], obs[rows],
                                    None if is_init is None else is_init[rows],
                                    None if step_index is None else step_index[rows],
                                    None if extras is None else extras[rows], return_state), kw))
        return B, parts

    @staticmethod
    def _join(B, parts, results):
        if len(parts) == 1:
            return results[0]
        version = min(r.model_version for r in results)
        joined = []
        for name in StepResult._fields:
            if name == "model_version":
                continue
            vals = [getattr(r, name) for r in results]
            if vals[0] is None:
                joined.append(None)
                continue
            out = np.empty((B,) + vals[0].shape[1:], dtype=vals[0].dtype)
            for (_, rows, _, _), v in zip(parts, vals):
                out[rows] = v
            joined.append(out)
        return StepResult(joined[0], version, *joined[1:])

    def step(self, env_ids, obs, is_init=None, step_index=None, extras=None):
        """Client.step over the pool: output [B, H] in env_ids' order."""
        return self.step_result(env_ids, obs, is_init, step_index, extras).output

    def step_result(self, env_ids, obs, is_init=None, step_index=None, extras=None,
                    return_state=False, **policy):
        """Client.step_result over the pool (policy: Client.step_result's options). The parts
        run concurrently; model_version is the smallest of theirs. If a part fails, its
        RnndError (lowest target index first) is raised; parts that succeeded have advanced
        their envs (use step_index for safe retries)."""
        B, parts = self._parts(env_ids, obs, is_init, step_index, extras, return_state, policy)
        if not parts:  # no rows: let the first target answer as a single daemon would
            return self.clients[0].step_result(env_ids, obs, is_init, step_index, extras,
                                               return_state, **policy)
        futures = []
        for t, _, args, kw in parts:
            c = self.clients[t]
            futures.append(c._stub.Step.future(_step_request(*args, **kw),
                                               timeout=c.timeout, metadata=c._metadata))
        results, error = [], None
        for (t, _, _, _), f in zip(parts, futures):
            try:
                results.append(_step_result(f.result()))
            except grpc.RpcError as e:
                if error is None:
                    error = _target_error(e, self.targets[t], "Step")
        if error is not None:
            raise error
        return self._join(B, parts, results)

    def end_episodes(self, env_ids):
        """Client.end_episodes over the pool: the number of envs released on all targets."""
        ids = np.asarray(_ids(env_ids), dtype=np.uint64)
        return sum(self.clients[t].end_episodes(ids[rows]) for t, rows in self.split(ids))

    def stepper(self):
        """A PoolStepper: one StepStream per target, opened when first needed."""
        return PoolStepper(self)

    # -- calls to every target --------------------------------------------------------------------

    def health(self, service=""):
        """[status string per target]."""
        return [c.health(service) for c in self.clients]

    def info(self):
        """[ModelInfo per target]."""
        return [c.info() for c in self.clients]

    def set_weights(self, tensors):
        """SetWeights on every target; returns [model_version per target]."""
        return [c.set_weights(tensors) for c in self.clients]


def _target_error(err, target, method):
    e = RnndError.from_rpc_error(err, method)
    return RnndError(e.code, "target %s: %s" % (target, e.details), method, target)


class PoolStepper(_SendRecv):
    """Stepper over a Pool: send() splits a request and sends each part on its target's stream;
    recv() returns the oldest request's reply in its row order. An error breaks the stepper (as
    it ends a gRPC stream): later calls raise. One thread at a time."""

    def __init__(self, pool):
        self._pool = pool
        self._steppers = {}
        self._inflight = []
        self._broken = False

    def _check(self):
        if self._broken:
            raise RnndError(grpc.StatusCode.CANCELLED, "the pool stepper is broken by an earlier "
                            "error", "StepStream")

    def send(self, env_ids, obs, is_init=None, step_index=None, extras=None, return_state=False,
             **policy):
        self._check()
        B, parts = self._pool._parts(env_ids, obs, is_init, step_index, extras, return_state,
                                     policy)
        if not parts:
            parts = [(0, np.zeros(0, dtype=np.int64),
                      (env_ids, obs, is_init, step_index, extras, return_state), policy)]
        try:
            for t, _, args, kw in parts:
                s = self._steppers.get(t)
                if s is None:
                    s = self._steppers[t] = self._pool.clients[t].stepper()
                s.send(*args, **kw)
        except BaseException:
            self._broken = True
            raise
        self._inflight.append((B, parts))

    def recv(self):
        self._check()
        if not self._inflight:
            raise RuntimeError("PoolStepper.recv() with no request in flight")
        B, parts = self._inflight.pop(0)
        results = []
        for t, _, _, _ in parts:
            try:
                results.append(self._steppers[t].recv())
            except RnndError as e:
                self._broken = True
                target = self._pool.targets[t]
                raise RnndError(e.code, "target %s: %s" % (target, e.details), "StepStream",
                                target) from None
        return Pool._join(B, parts, results)

    def close(self):
        for s in self._steppers.values():
            s.close()
        self._inflight.clear()
        self._broken = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            for s in self._steppers.values():
                s._call.cancel()
        self.close()
