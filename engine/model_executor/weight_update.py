"""A loaded model's weights, updated and read in place (this TP rank's shard), under checkpoint names.

An update goes through the model's own load_weights, which shards each full checkpoint tensor by
the rank's TpGroup, in two passes:

    check(probes)   load_weights over shape-only (meta) tensors in a dry run: every write a loader
                    makes is skipped and recorded (which parameter it lands in); a name without a
                    parameter, a shape that differs (no broadcasting), non-float data for a float
                    parameter, and (for a whole checkpoint) a parameter left unfilled are refused.
                    Nothing is written, so a refused update leaves the old weights serving.
    write(tensors)  the same load_weights over the real tensors.

Parameters are written in place, never replaced: CUDA graphs, compiled graphs and the native CPU
forward hold their addresses. A bfloat16 layer the packed CPU kernel serves keeps a packed copy and
a placeholder for its weight (layers/linear.py pack_linear_weights): for an update the weight is
unpacked, written and packed again into the same buffer. A vision-language model's cache of image
embeddings is cleared (the tower may have changed). An EAGLE draft checkpoint (draft_head) is not
part of the model's checkpoint and keeps its weights.

read() gives this rank's part of a checkpoint tensor: load_weights over an index probe (each element
its own position, 1-based, in float64) into float64 stand-ins for the parameters it fills, then each
parameter's values go back to the positions the probe left in it, whatever the layer's sharding.
The ranks' parts add up to the whole tensor (worker/weights.py).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from baton.engine.kernels import cpu_linear
from baton.engine.model_config import ModelConfig
from baton.engine.model_executor.model_loader import iterate_safetensors, safetensors_files

if TYPE_CHECKING:
    from baton.engine.model_executor.model_runner import ModelRunner

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# parameters a model's checkpoint does not fill (loaded from a checkpoint of their own)
_NOT_IN_CHECKPOINT = ("draft_head.",)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
LOAD_FORMATS = (None, "auto", "safetensors")


class WeightsError(ValueError):
    """An update or read refused before anything was written; the message says why."""


class _DryRun(TorchFunctionMode):
    """A loader's writes, recorded and skipped: per parameter, how many of its elements they fill
    (loaders fill disjoint parts: a fused q|k|v weight takes three writes)."""

    _WRITES = frozenset({"copy_", "zero_", "fill_", "__setitem__"})

    def __init__(self, owner: Callable[[torch.Tensor], Optional[str]]) -> None:
        super().__init__()
        self.owner = owner
        self.filled: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if getattr(func, "__name__", "") in self._WRITES and args and isinstance(args[0], torch.Tensor):
            dst = args[0]
            if func.__name__ == "copy_":
                _check_copy(dst, args[1])
            if (name := self.owner(dst)) is not None:
                part = dst[args[1]] if func.__name__ == "__setitem__" else dst
                self.filled[name] = self.filled.get(name, 0) + part.numel()
            return None if func.__name__ == "__setitem__" else dst
        return func(*args, **(kwargs or {}))


def _check_copy(dst: torch.Tensor, src: Any) -> None:
    if not isinstance(src, torch.Tensor):
        return
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"a tensor of shape {list(src.shape)} for a parameter part of shape {list(dst.shape)}")
    if dst.dtype.is_floating_point and not src.dtype.is_floating_point:
        raise WeightsError(f"{src.dtype} data for a {dst.dtype} parameter")


def meta_like(shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(list(shape), dtype=dtype, device="meta")


def checkpoint_manifest(path: str) -> dict[str, tuple[list[int], torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a safetensors checkpoint, from the files' headers."""
    from safetensors import safe_open

    out: dict[str, tuple[list[int], torch.dtype]] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (list(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype(), torch.uint8))
    return out


class ModelWeights:
    """One rank's model, as checkpoint tensors go in and out of it."""

    def __init__(self, runner: "ModelRunner") -> None:
        self.runner, self.model = runner, runner.model
        self.checkpoint_path = runner.config.model_path  # where the weights served now came from
        self._manifest: Optional[dict[str, tuple[list[int], torch.dtype]]] = None

    # ---- names ----
    def _params(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if not n.startswith(_NOT_IN_CHECKPOINT)}

    def _owner_of(self) -> Callable[[torch.Tensor], Optional[str]]:
        """A tensor -> the name of the parameter it is (or is a view of), else None."""
        ids = {id(p): n for n, p in self._params().items()}

        def owner(t: torch.Tensor) -> Optional[str]:
            while id(t) not in ids and t._base is not None:
                t = t._base
            return ids.get(id(t))

        return owner

    @property
    def manifest(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """The served checkpoint's tensors (an update keeps every shape, so this stays true)."""
        if self._manifest is None:
            self._manifest = checkpoint_manifest(self.checkpoint_path)
        return self._manifest

    # ---- updates ----
    def check(self, probes: NamedTensors, complete: bool) -> set[str]:
        """The parameters these tensors (real or meta: only shapes and dtypes are read) would fill;
        WeightsError when they do not fit the model, or (`complete`) leave a parameter unfilled."""
        current = [""]  # the tensor being loaded, for the message

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in probes:
                current[0] = name
                yield name, (t if t.device.type == "meta" else meta_like(t.shape, t.dtype))

        dry = _DryRun(self._owner_of())
        try:
            with dry:
                self.model.load_weights(named(), strict=False)
        except KeyError as e:
            raise WeightsError(str(e.args[0]) if e.args else repr(e)) from e
        except (ValueError, AssertionError, RuntimeError, IndexError, TypeError, NotImplementedError) as e:
            raise WeightsError(f"{current[0]}: {e}" if current[0] else f"{type(e).__name__}: {e}") from e
        if complete:
            missing = sorted(n for n, p in self._params().items() if dry.filled.get(n, 0) < p.numel())
            if missing:
                raise WeightsError(f"the checkpoint leaves {len(missing)} of the model's parameters unfilled (or "
                                   f"partly filled), e.g. {missing[:5]}")
        return set(dry.filled)

    def check_checkpoint(self, path: str, load_format: Optional[str]) -> set[str]:
        """A checkpoint directory for an update from disk: the served architecture, every parameter
        filled, every shape the model's. Reads the files' headers only."""
        if load_format not in LOAD_FORMATS:
            raise WeightsError(f"load_format {load_format!r} is not supported: safetensors checkpoints only "
                               "(auto or safetensors)")
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
            raise WeightsError(f"model_path {path!r} is not a checkpoint directory (no config.json there)")
        try:
            arch = ModelConfig.from_pretrained(path).architecture
            manifest = checkpoint_manifest(path)
        except Exception as e:  # noqa: BLE001 - a foreign or damaged checkpoint: whatever its reader raised
            raise WeightsError(f"cannot read the checkpoint at {path!r}: {e}") from e
        served = self.runner.model_config.architecture
        if arch != served:
            raise WeightsError(f"{path!r} is a {arch} checkpoint; this engine serves {served}: an update keeps the "
                               "architecture")
        return self.check(((n, meta_like(s, d)) for n, (s, d) in manifest.items()), complete=True)

    def load_checkpoint(self, path: str, touched: set[str]) -> None:
        """Write a checkpoint that check_checkpoint accepted."""
        self.write(iterate_safetensors(safetensors_files(path)), touched)
        self.checkpoint_path, self._manifest = path, None

    def write(self, tensors: NamedTensors, touched: set[str]) -> None:
        """Write tensors that check() accepted (`touched`: what it returned)."""
        with self._writable(touched), torch.no_grad():
            self.model.load_weights(tensors, strict=False)
        embedder = self.runner.mm_embedder
        if embedder is not None:
            embedder.cache.clear()

    @contextlib.contextmanager
    def _writable(self, touched: set[str]) -> Iterator[None]:
        """The packed layers among `touched` with their weights unpacked, packed again after."""
        packed = []
        for name in sorted(touched):
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            if attr == "weight" and getattr(module, "packed_weight", None) is not None:
                released = cpu_linear.is_released(module.weight)
                if released:
                    module.weight = _like(module.weight, cpu_linear.unpack_weight(module.packed_weight))
                packed.append((module, released))
        try:
            yield
        finally:
            for module, released in packed:
                module.packed_weight.copy_(cpu_linear.pack_weight(module.weight))
                if released:
                    module.weight = _like(module.weight, cpu_linear.released_placeholder(module.weight))

    # ---- reads ----
    def read(self, name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """This rank's part of checkpoint tensor `name`, its first `rows` rows flattened: (values, how
        many of this rank's parameter elements gave each, float64 both) and the tensor's shape."""
        if name == "lm_head.weight" and getattr(self.model, "lm_head", True) is None:
            name = "model.embed_tokens.weight"  # a tied LM head is the embedding
        if name not in self.manifest:
            raise WeightsError(f"no tensor {name!r} in the served checkpoint")
        shape, _ = self.manifest[name]
        limit = min(rows, shape[0] if shape else 1) * math.prod(shape[1:])
        touched = self.check([(name, meta_like(shape, torch.float64))], complete=False)
        values = torch.zeros(limit, dtype=torch.float64)
        counts = torch.zeros(limit, dtype=torch.float64)
        for pname, index in self._index_probes(name, shape, touched).items():
            flat = index.reshape(-1)
            mine = (flat >= 1) & (flat <= limit)
            at = flat[mine].to(torch.int64) - 1
            values.index_add_(0, at, self._values(pname).reshape(-1)[mine])
            counts.index_add_(0, at, torch.ones_like(at, dtype=torch.float64))
        return values, counts, shape

    def _index_probes(self, name: str, shape: list[int], touched: set[str]) -> dict[str, torch.Tensor]:
        """Each parameter `name` fills -> float64 of its shape: the 1-based position in the checkpoint
        tensor of the element it took there, < 1 where it took none."""
        probes: dict[str, nn.Parameter] = {}
        saved = []
        for pname in sorted(touched):
            module_name, _, attr = pname.rpartition(".")
            module = self.model.get_submodule(module_name)
            old = module._parameters[attr]
            probe = nn.Parameter(torch.full(old.shape, -1.0, dtype=torch.float64), requires_grad=False)
            probe.__dict__.update(old.__dict__)  # its shard loader
            module._parameters[attr] = probes[pname] = probe
            saved.append((module, attr, old))
        try:
            index = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
            with torch.no_grad():
                self.model.load_weights([(name, index)], strict=False)
        except Exception as e:  # noqa: BLE001 - a loader that cannot take the probe: the read is refused
            raise WeightsError(f"{name}: cannot be read back ({type(e).__name__}: {e})") from e
        finally:
            for module, attr, old in saved:
                module._parameters[attr] = old
        for pname, probe in probes.items():
            if not torch.equal(probe, probe.round()):
                raise WeightsError(f"{name}: the loader of {pname} transforms the values; it cannot be read back")
        return {pname: probe.detach() for pname, probe in probes.items()}

    def _values(self, pname: str) -> torch.Tensor:
        """A parameter's values as float64 on the CPU (a packed layer's from its packed copy)."""
        module_name, _, attr = pname.rpartition(".")
        module = self.model.get_submodule(module_name)
        param = getattr(module, attr)
        if attr == "weight" and cpu_linear.is_released(param):
            param = cpu_linear.unpack_weight(module.packed_weight)
        return param.detach().to("cpu", torch.float64)


def _like(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding `data` that keeps `old`'s attributes (its shard loader)."""
    new = nn.Parameter(data, requires_grad=False)
    new.__dict__.update(old.__dict__)
    return new
