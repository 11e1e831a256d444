"""Named tensors between processes by handle (shared memory, CUDA IPC), as SGLang sends them.

SGLang's MultiprocessingSerializer, for /update_weights_from_tensor: a list of (name, tensor) pickled
with torch's multiprocessing reductions, so the bytes hold a handle to the tensor's memory, never its
data (base64 over HTTP).

- CPU: shared memory by file name. The sender calls
  torch.multiprocessing.set_sharing_strategy("file_system") first: the default strategy passes a file
  descriptor through the sender's own socket, which only its child processes may reach. The sender
  keeps the tensors alive until the update has answered.
- CUDA: CUDA IPC handles (the receiver maps the sender's device memory), on a CUDA engine only.

Reading them unpickles, so only what these reductions name may be loaded: tensor and storage
rebuilders, dtypes and sizes, lists and tuples (no other callable), and a CUDA handle only where
the engine runs on CUDA.
"""
from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import torch

_REBUILDERS = {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_empty",
               "rebuild_typed_storage_child"}
_CUDA_REBUILDERS = {"rebuild_cuda_tensor"}
_TORCH_CLASSES = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
                  ("torch.storage", "TypedStorage"), ("torch.nn.parameter", "Parameter")}


class NamedTensorsError(ValueError):
    """The bytes are not a serialized list of (name, tensor) this engine can map."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, cuda: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.cuda = cuda

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions":
            if name in _REBUILDERS or (self.cuda and name in _CUDA_REBUILDERS):
                return super().find_class(module, name)
            if name in _CUDA_REBUILDERS:
                raise NamedTensorsError("CUDA IPC tensors reach a CUDA engine only; this engine runs on CPU")
            if name == "rebuild_storage_fd":
                raise NamedTensorsError(
                    "tensors shared by file descriptor cannot reach another process: call "
                    "torch.multiprocessing.set_sharing_strategy('file_system') before serializing")
        if (module, name) in _TORCH_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise NamedTensorsError(f"serialized named tensors may not reference {module}.{name}")


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], as_base64: bool = True) -> Any:
    """What a client sends: the list pickled with the multiprocessing reductions (CPU tensors need the
    file_system sharing strategy, set by the caller), as base64 text for HTTP or raw bytes."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    raw = buf.getvalue()
    return base64.b64encode(raw).decode() if as_base64 else raw


def deserialize_named_tensors(data: bytes | str, cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of serialize_named_tensors' output (bytes or base64 text), mapped from
    the sender's memory. Raises NamedTensorsError on anything else."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError as e:
            raise NamedTensorsError(f"serialized named tensors are not base64: {e}") from e
    try:
        obj = _Unpickler(data, cuda).load()
    except NamedTensorsError:
        raise
    except Exception as e:  # a truncated or foreign pickle, a shared-memory name that is gone
        raise NamedTensorsError(f"cannot read the serialized named tensors: {type(e).__name__}: {e}") from e
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise NamedTensorsError("serialized named tensors must be a list of (name, tensor) pairs")
    return [(name, t) for name, t in obj]
