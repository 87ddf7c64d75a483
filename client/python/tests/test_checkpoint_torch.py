"""Checkpoints and PyTorch (issue 6), both ways, for nn.GRU and nn.LSTM with 2 layers:

- a checkpoint's model.safetensors, read with plain torch from the file format (8-byte header
  length, JSON header, raw little-endian data; no safetensors package needed), loads into
  nn.GRU / nn.LSTM with load_state_dict(strict=True), and that module computes what the daemon's
  Forward computes;
- a module trained in PyTorch, saved with rnnd.save_safetensors(module.state_dict()), starts a
  daemon through --weights, and the daemon then computes what the module computes.
"""

import json
import os
import struct
import tempfile
import unittest

import numpy as np

from _common import daemon, rel_err, skip

try:
    import torch
except ImportError:
    skip("PyTorch is not installed (Debian: python3-torch)")

import rnnd

I, H, L, B, T = 5, 7, 2, 3, 6
TOL = 1e-5  # fp32 on both sides (--compute ieee: no TF32 on a GPU host)
_TORCH_DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def torch_load_file(path):
    """The safetensors format read with torch alone: {name: tensor}."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    header.pop("__metadata__", None)
    data = bytearray(buf[8 + n:])
    out = {}
    for name, d in header.items():
        begin, end = d["data_offsets"]
        t = torch.frombuffer(data[begin:end], dtype=_TORCH_DTYPES[d["dtype"]])
        out[name] = t.reshape(d["shape"]).clone()
    return out


def module(cell):
    return (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(I, H, L, batch_first=True)


def torch_forward(mod, x):
    with torch.no_grad():
        out, _ = mod(torch.from_numpy(x))
    return out.numpy()


class CheckpointTorchTest(unittest.TestCase):
    def check_cell(self, cell):
        x = np.random.default_rng(7).uniform(-1, 1, (B, T, I)).astype(np.float32)
        with daemon(cell=cell, input_size=I, hidden_size=H, layers=L, seed=11,
                    compute="ieee") as d, d.client() as c:
            # Move the weights off their initial values, as training would.
            r = c.forward(x, keep_tape=True)
            g = c.backward(r.tape_id, r.output.copy())
            c.apply_gradients(g.grads, lr=0.05)
            want = c.forward(x).output
            ck = c.save_checkpoint()
            path = ck.path if os.path.isabs(ck.path) else os.path.join(d.state_dir, ck.path)
            state = torch_load_file(os.path.join(path, "model.safetensors"))

            mod = module(cell)
            mod.load_state_dict(state, strict=True)  # every name and shape, nothing extra
            self.assertLess(rel_err(torch_forward(mod, x), want), TOL)

            # The other way: a module trained in PyTorch starts a new daemon via --weights.
            torch.manual_seed(3)
            trained = module(cell)
            with tempfile.TemporaryDirectory() as tmp:
                file = os.path.join(tmp, "policy.safetensors")
                rnnd.save_safetensors(file, trained.state_dict())
                self.assertEqual(set(torch_load_file(file)), set(trained.state_dict()))
                with daemon(cell=cell, input_size=I, hidden_size=H, layers=L, compute="ieee",
                            weights=file) as d2, d2.client() as c2:
                    got = c2.forward(x).output
                    self.assertLess(rel_err(got, torch_forward(trained, x)), TOL)
                    w = c2.get_weights()
                    self.assertEqual(w.model_version, 0)
                    for k, v in trained.state_dict().items():
                        np.testing.assert_array_equal(w[k], v.numpy())

    def test_gru(self):
        self.check_cell("gru")

    def test_lstm(self):
        self.check_cell("lstm")

    def test_weights_of_another_shape_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            file = os.path.join(tmp, "small.safetensors")
            rnnd.save_safetensors(file, torch.nn.GRU(I, H, 1, batch_first=True).state_dict())
            d = daemon(cell="gru", input_size=I, hidden_size=H, layers=L, weights=file,
                       ready_timeout=20)
            with self.assertRaises(Exception):
                d.start()
            d.stop()
            text = "\n".join(d.log)
            self.assertIn("--weights", text)
            self.assertIn("weight_ih_l1", text)


if __name__ == "__main__":
    unittest.main()
