"""rnnd: Python client for the rnnd daemon (recurrent RL policies served over gRPC).

    import rnnd
    c = rnnd.Client("127.0.0.1:50051")
    out = c.step(env_ids, obs, is_init)          # numpy [B, H]

``rnnd.torch`` (import it explicitly; needs PyTorch) has RemoteRecurrent, an nn.Module whose
forward and backward run on the daemon.
"""

from .client import (BackwardResult, Checkpoint, Client, ForwardResult, ModelInfo, RnndError,
                     StepResult, Stepper, Weights)
from .daemon import Daemon
from .safetensors import load_safetensors
from ._tensor import decode as decode_tensor, encode as encode_tensor

__version__ = "0.1.0"

__all__ = ["Client", "Stepper", "RnndError", "Daemon", "ModelInfo", "StepResult", "ForwardResult",
           "BackwardResult", "Checkpoint", "Weights", "load_safetensors", "decode_tensor",
           "encode_tensor"]
