"""rnnd: Python client for the rnnd daemon (recurrent RL policies served over gRPC).

    import rnnd
    c = rnnd.Client("127.0.0.1:50051")
    out = c.step(env_ids, obs, is_init)          # numpy [B, H]

``rnnd.Pool`` takes several targets and places each env on one of them by rendezvous hashing
(the same placement as the C client's rnnd_client_pool).

``rnnd.torch`` (import it explicitly; needs PyTorch) has RemoteRecurrent, an nn.Module whose
forward and backward run on the daemon.
"""

from .client import (BackwardResult, Checkpoint, Client, ForwardResult, ModelInfo, RnndError,
                     StepResult, Stepper, Weights)
from .daemon import Daemon
from .pool import Pool, PoolStepper, pick as rendezvous_pick, target_hash as rendezvous_target_hash
from .safetensors import load_safetensors, save_safetensors
from ._tensor import decode as decode_tensor, encode as encode_tensor

__version__ = "0.1.0"

__all__ = ["Client", "Stepper", "RnndError", "Daemon", "Pool", "PoolStepper", "rendezvous_pick",
           "rendezvous_target_hash", "ModelInfo", "StepResult", "ForwardResult",
           "BackwardResult", "Checkpoint", "Weights", "load_safetensors", "save_safetensors",
           "decode_tensor",
           "encode_tensor"]
