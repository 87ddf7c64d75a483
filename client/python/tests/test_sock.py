"""Socket regions against a real daemon (CPU backend): rnnd.Client(transport="socket") sends and
receives torch tensors through the daemon's memory over a data connection. Forward over recorded
trajectories and Backward give the bytes path's results bit for bit (fp32 and bfloat16 on the
wire), NaN or Inf in a gradient is refused with the element named and the tape kept, a learner
through rnnd.torch.RemoteRecurrent matches one on bytes, large transfers split over the
region's four data connections (a fifth refused, any one closing ends the region), the region
goes when
the client closes, a daemon over two devices takes it too, a lost data connection costs one
call, "auto" takes it for a daemon on another host (this host's own non-loopback address) and
not for one on this host, a daemon with --data-listen off refuses it, and a data port the client
cannot reach gives the region back at once."""

import socket
import struct
import time
import unittest
import urllib.request

import numpy as np

from _common import BACKEND, daemon, skip

try:
    import torch
except ImportError:
    skip("no torch")

import rnnd
import rnnd.torch
import rnnd.v1.rnnd_pb2

I, H, L = 6, 32, 2
# The learner's device: CUDA tensors where there is a GPU (the GPU host), else CPU ones.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def host_ip():
    """An IPv4 address of this host other than loopback, or None."""
    import fcntl
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name[:15].encode())
                ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            if not ip.startswith("127."):
                return ip
    finally:
        s.close()
    return None


def metric(d, name):
    with urllib.request.urlopen("http://%s/metrics" % d.http, timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError("no %s in /metrics" % name)


def regions(d):
    return metric(d, "rnnd_shm_regions")


class SocketRegionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = daemon(cell="lstm", layers=L, input_size=I, hidden_size=H, trajectory_steps=16,
                       seed=3).start()
        cls.b = cls.d.client(transport="grpc")
        cls.rng = np.random.default_rng(1)

    @classmethod
    def tearDownClass(cls):
        cls.b.close()
        cls.d.stop()

    def assertGrads(self, gs, gb, what):
        """The weight gradients gs (torch, through the region) equal gb's (numpy, as bytes)."""
        for name in gb.grads:
            self.assertTrue(torch.equal(gs.grads[name].cpu(),
                                        torch.from_numpy(np.array(gb.grads[name]))),
                            "%s %s" % (what, name))

    def x(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def steps(self, ids, T):
        for t in range(T):
            self.b.step(ids, self.x(len(ids), I), is_init=(self.rng.random(len(ids)) < 0.2) |
                        (t == 0))

    def test_equals_bytes(self):
        ids = np.arange(100, 105, dtype=np.uint64)
        T = 9
        self.steps(ids, T)
        sent, got = (metric(self.d, 'rnnd_data_bytes_total{direction="%s"}' % k)
                     for k in ("out", "in"))
        with self.d.client(transport="socket", sock_mb=4) as s:
            for wire in ("float32", "bfloat16"):
                fb = self.b.forward_recorded(ids, T, keep_tape=True, fields=("is_init",),
                                             reply_dtype=wire)
                fs = s.forward_recorded(ids, T, keep_tape=True, fields=("is_init",),
                                        reply_dtype=wire, device=DEV)
                self.assertEqual(s.transport, "socket")
                self.assertIsInstance(fs.output, torch.Tensor)
                self.assertEqual(fs.output.device.type, DEV.type)
                self.assertTrue(torch.equal(fs.output.cpu(), torch.from_numpy(fb.output)), wire)
                self.assertTrue(torch.equal(fs.is_init.cpu(), torch.from_numpy(fb.is_init)))
                self.assertIsNone(fs.obs)
                go = self.x(len(ids), T, H)
                gb = self.b.backward(fb.tape_id, go, dtype=wire, input_grads=())
                gs = s.backward(fs.tape_id, torch.from_numpy(go).to(DEV), dtype=wire,
                                input_grads=())
                self.assertEqual(sorted(gs.grads), sorted(gb.grads))
                self.assertGrads(gs, gb, wire)
            # A window larger than the region: the call goes as bytes, with the same result.
            big = np.arange(200, 264, dtype=np.uint64)
            self.steps(big, 16)
            fb = self.b.forward_recorded(big, 16, fields=())
            fs = s.forward_recorded(big, 16, fields=(), device=DEV)
            self.assertTrue(torch.equal(torch.as_tensor(fs.output).cpu(),
                                        torch.from_numpy(fb.output)))
            self.assertEqual(regions(self.d), 1)
            self.assertEqual(metric(self.d, "rnnd_socket_region_bytes"), 4 << 20)
            # The replies' outputs went out over the data connection, the gradients came in.
            out = 4 * len(ids) * T * H + 2 * len(ids) * T * H
            self.assertGreaterEqual(
                metric(self.d, 'rnnd_data_bytes_total{direction="out"}') - sent, out)
            self.assertGreaterEqual(
                metric(self.d, 'rnnd_data_bytes_total{direction="in"}') - got, out)
        # Closed with the client (ReleaseRegion, then the connection).
        for _ in range(50):
            if regions(self.d) == 0:
                break
            time.sleep(0.1)
        self.assertEqual(regions(self.d), 0)
        self.assertEqual(metric(self.d, "rnnd_socket_region_bytes"), 0)

    def test_non_finite_refused(self):
        # The daemon checks a socket region's gradients on its backend, once they are in place:
        # NaN or Inf is refused with the element named, and the tape stays for a good Backward.
        ids = np.arange(300, 304, dtype=np.uint64)
        T = 5
        self.steps(ids, T)
        with self.d.client(transport="socket", sock_mb=4) as s:
            for wire, bad in (("float32", float("nan")), ("bfloat16", float("inf"))):
                fb = self.b.forward_recorded(ids, T, keep_tape=True, fields=())
                fs = s.forward_recorded(ids, T, keep_tape=True, fields=(), device=DEV)
                go = self.x(len(ids), T, H)
                bad_go = go.copy()
                bad_go[2, 3, 7] = bad
                with self.assertRaises(rnnd.RnndError) as e:
                    s.backward(fs.tape_id, torch.from_numpy(bad_go).to(DEV), dtype=wire,
                               input_grads=())
                self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
                at = (2 * T + 3) * H + 7
                self.assertIn("element %d is NaN or infinite" % at, str(e.exception))
                gb = self.b.backward(fb.tape_id, go, dtype=wire, input_grads=())
                gs = s.backward(fs.tape_id, torch.from_numpy(go).to(DEV), dtype=wire,
                                input_grads=())
                self.assertGrads(gs, gb, wire)
            self.assertEqual(s.transport, "socket")

    def test_learner(self):
        """A learner step through rnnd.torch on socket regions: the same loss, gradients and
        new weights as on bytes."""
        B, T = 4, 8
        ids = np.arange(300, 300 + B, dtype=np.uint64)
        self.steps(ids, T)
        out = []
        for transport in ("grpc", "socket"):
            with self.d.client(transport=transport) as c:
                core = rnnd.torch.RemoteRecurrent(c, grads="server").to(DEV)
                y, _ = core.forward_recorded(torch.from_numpy(ids.view(np.int64)), T, fields=())
                loss = (y ** 2).mean()
                loss.backward()
                self.assertEqual(c.transport, transport)
                out.append((loss.item(), {n: p.grad.cpu() for n, p in core.named_parameters()}))
        self.assertEqual(out[0][0], out[1][0])
        for name in out[0][1]:
            self.assertTrue(torch.equal(out[0][1][name], out[1][1][name]), name)

    def test_devices(self):
        """A daemon over two devices (the batch split by env): socket regions are host memory,
        so they serve it as they serve one device, with the bytes path's results. Each device
        checks its rows of the gradients before either changes anything: a NaN is refused with
        its element in the request named, and the tape stays for a good Backward."""
        if BACKEND == "cuda" and torch.cuda.device_count() < 2:
            self.skipTest("one GPU")
        with daemon(input_size=I, hidden_size=H, trajectory_steps=8, devices="0,1") as d:
            ids = np.arange(16, dtype=np.uint64)
            with d.client(transport="grpc") as b, d.client(transport="socket", sock_mb=4) as s:
                for t in range(6):
                    b.step(ids, self.x(16, I), is_init=t == 0)
                fb = b.forward_recorded(ids, 6, keep_tape=True, fields=())
                fs = s.forward_recorded(ids, 6, keep_tape=True, fields=(), device=DEV)
                self.assertTrue(torch.equal(fs.output.cpu(), torch.from_numpy(fb.output)))
                go = self.x(16, 6, H)
                for row in (0, 9, 15):  # rows on either device
                    bad = go.copy()
                    bad[row, 4, 3] = float("nan")
                    with self.assertRaises(rnnd.RnndError) as e:
                        s.backward(fs.tape_id, torch.from_numpy(bad).to(DEV), input_grads=())
                    self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
                    self.assertIn("grad_output: element %d is NaN" % ((row * 6 + 4) * H + 3),
                                  str(e.exception))
                gb = b.backward(fb.tape_id, go, input_grads=())
                gs = s.backward(fs.tape_id, torch.from_numpy(go).to(DEV), input_grads=())
                self.assertGrads(gs, gb, "devices")
                self.assertEqual(s.transport, "socket")

    def test_devices_row_workers(self):
        """A batch big enough that each device copies its rows between the region and its own
        memory on its row workers too (--reply-threads 2, a MiB or more each): the bytes path's
        results, in fp32 and bfloat16."""
        if BACKEND == "cuda" and torch.cuda.device_count() < 2:
            self.skipTest("one GPU")
        B, T = 6144, 6
        with daemon(input_size=I, hidden_size=H, trajectory_steps=8, devices="0,1",
                    max_envs=B, max_batch=B, reply_threads=2) as d:
            ids = np.arange(B, dtype=np.uint64)
            with d.client(transport="grpc") as b, d.client(transport="socket", sock_mb=16) as s:
                for t in range(T):
                    b.step(ids, self.x(B, I), is_init=t == 0)
                for wire in ("float32", "bfloat16"):
                    fb = b.forward_recorded(ids, T, keep_tape=True, fields=(), reply_dtype=wire)
                    fs = s.forward_recorded(ids, T, keep_tape=True, fields=(), reply_dtype=wire,
                                            device=DEV)
                    self.assertTrue(torch.equal(fs.output.cpu(), torch.from_numpy(fb.output)),
                                    wire)
                    go = self.x(B, T, H)
                    gb = b.backward(fb.tape_id, go, dtype=wire, input_grads=())
                    gs = s.backward(fs.tape_id, torch.from_numpy(go).to(DEV), dtype=wire,
                                    input_grads=())
                    self.assertGrads(gs, gb, wire)

    def test_connection_lost(self):
        """The region gone under the client (here released behind its back): the call that
        finds the connection closed raises ConnectionError, the next one registers a new region
        and goes through."""
        ids = np.arange(400, 403, dtype=np.uint64)
        self.steps(ids, 4)
        with self.d.client(transport="socket", sock_mb=4) as s:
            first = s.forward_recorded(ids, 4, fields=(), device=DEV).output
            region = next(r for r in s._regions.values() if r)
            s._call("ReleaseRegion", rnnd.v1.rnnd_pb2.ReleaseRegionRequest(region=region.id))
            with self.assertRaises(ConnectionError):
                s.forward_recorded(ids, 4, fields=(), device=DEV)
            self.assertTrue(region.closed)
            again = s.forward_recorded(ids, 4, fields=(), device=DEV).output
            self.assertTrue(torch.equal(first, again))
            self.assertEqual(s.transport, "socket")
            self.assertIsNot(next(r for r in s._regions.values() if r), region)

    def test_split_over_connections(self):
        """A region's 4 data connections: a transfer of rnnd.sock.SPLIT bytes or more is split
        over them and comes back bit for bit (one connection too), the daemon refuses a fifth
        connection with the key and keeps the region, and any one connection closing ends the
        region: the next call raises ConnectionError and the one after registers anew."""
        from rnnd import sock
        with self.assertRaises(ValueError):
            rnnd.Client(self.d.target, sock_conns=5)
        ids = np.arange(500, 502, dtype=np.uint64)
        self.steps(ids, 2)
        n = 2 * sock.SPLIT + 4 * 997  # parts of unequal length
        data = torch.from_numpy(self.rng.integers(0, 256, n, dtype=np.uint8))
        for conns in (4, 1):
            with self.d.client(transport="socket", sock_mb=16, sock_conns=conns) as s:
                first = s.forward_recorded(ids, 2, fields=(), device=DEV).output
                region = next(r for r in s._regions.values() if r)
                self.assertEqual(len(region.socks), conns)
                region.write(64, data.to(DEV))
                region.sync()
                back = region.read(64, n)
                self.assertEqual(back.device.type, DEV.type)
                self.assertTrue(torch.equal(back.cpu(), data), conns)
                self.assertTrue(torch.equal(region.read(64 + 5 * 997, 3).cpu(),
                                            data[5 * 997:5 * 997 + 3]))
                if conns == 1:
                    continue
                extra = socket.create_connection(region.socks[0].getpeername()[:2], timeout=10)
                extra.sendall(sock.HELLO + region.key)
                self.assertEqual(extra.recv(8), b"")  # closed: the region has its four
                extra.close()
                self.assertTrue(torch.equal(region.read(64, n).cpu(), data))
                region.socks[2].close()
                with self.assertRaises(ConnectionError):
                    for _ in range(50):  # until the daemon has seen it close
                        s.forward_recorded(ids, 2, fields=(), device=DEV)
                        time.sleep(0.1)
                again = s.forward_recorded(ids, 2, fields=(), device=DEV).output
                self.assertTrue(torch.equal(first, again))
                self.assertIsNot(next(r for r in s._regions.values() if r), region)
        for _ in range(50):
            if regions(self.d) == 0:
                break
            time.sleep(0.1)
        self.assertEqual(regions(self.d), 0)

    def test_auto_from_another_host(self):
        """A target that is not loopback (this host's own address, which the daemon cannot tell
        from another host's): "auto" takes a socket region for torch tensors by itself."""
        ip = host_ip()
        if ip is None:
            self.skipTest("no address but loopback here")
        with daemon(input_size=I, hidden_size=H, listen="0.0.0.0:0") as d:
            port = next(a for a in d.addresses if a.startswith("0.0.0.0:")).split(":")[1]
            ids = [1, 2]
            with d.client() as loop:
                loop.step(ids, self.x(2, I), is_init=True)
            with rnnd.Client("%s:%s" % (ip, port)) as far:
                f = far.forward_recorded(ids, 1, keep_tape=True, fields=(), device=DEV)
                self.assertEqual(far.transport, "socket")
                g = far.backward(f.tape_id, torch.ones(2, 1, H, device=DEV), input_grads=())
                self.assertEqual(g.grads["weight_hh_l0"].shape, (3 * H, H))

    def test_off_and_auto(self):
        with daemon(input_size=I, hidden_size=H, data_listen="off") as d:
            with d.client(transport="socket") as s:
                with self.assertRaises(rnnd.RnndError) as cm:
                    s.forward_recorded([1], 1, device=torch.device("cpu"))
                self.assertIn("--data-listen", cm.exception.details)
        # A data port the client cannot reach: the daemon listens on another loopback address
        # than the gRPC target's, on a port that this test holds bound but not listening on the
        # target's (so the client's connection is refused, whatever else runs here). The call
        # fails, and the region it registered is released at once.
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with held, daemon(input_size=I, hidden_size=H, data_listen="127.0.0.2:%d" % port) as d:
            with d.client(transport="socket") as s:
                with self.assertRaises(ConnectionRefusedError):
                    s.forward_recorded([1], 1, device=torch.device("cpu"))
                self.assertEqual(regions(d), 0)
        # "auto" on this host: CPU tensors go as bytes (or shared memory), never a socket region;
        # CUDA tensors to a daemon on this host take a CUDA region (or bytes), not one either.
        with self.d.client() as a:
            self.assertIsNone(a._region_for(torch.device("cpu")))
            self.assertNotEqual(a.transport, "socket")


if __name__ == "__main__":
    unittest.main(verbosity=2)
