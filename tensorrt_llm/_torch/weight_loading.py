"""HF checkpoint loading: safetensors (single file or sharded), name mapping, meta-device build.

How the engine builds a model (see `load_model`):
  1. `build_model_on_meta(cls, model_config, device)`: construct under `torch.device("meta")`
     (no memory touched), then materialise every parameter as an empty tensor on `device`.
     Buffers built with an explicit device (rotary tables, caches) keep their values and move
     to `device`; a module whose buffers are still on meta must define `init_buffers(device)`.
  2. `load_safetensors_checkpoint(dir)` reads all shards (tqdm progress bar).
  3. `model.load_weights(weights)` maps HF names onto the model through `load_hf_weights`,
     which fills fused projections from their HF parts and raises a ValueError naming any
     missing or unexpected weights.

Tensor parallelism: a module built for one rank records the checkpoint slice of each of its
parameters (`tp_shards`, modules/tensor_parallel.py); `load_hf_weights` copies only those
slices, and `load_model` of a sharded model reads the files lazily (`checkpoint_slices.py`),
so a rank never holds another rank's weights.

Block-FP8 checkpoints: `build_model_on_meta(..., prepare=)` switches the chosen `Linear`s to
block-FP8 while the model is still on meta (so the weights never exist in 16 bits on the
device), and `load_hf_weights` hands each such layer its e4m3 `weight` and fp32
`weight_scale_inv` shards (`Linear.load_fp8_block_shards`; a tensor-parallel rank's slices of
both, `fp8_block_linear.shard_block_scales`). An e4m3 tensor is never copied
into a 16-bit parameter (nor the reverse): that is an error naming the weight.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from .checkpoint_slices import lazy_safetensors_checkpoint, materialize
from .distributed import AnyShard

# our fused projection -> the HF projections stacked along the output dim, in order
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# HF checkpoint entries that carry no weights we use
DEFAULT_IGNORE: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)
_SCALE = "weight_scale_inv"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def checkpoint_shards(checkpoint_dir: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of a checkpoint folder, plus the index's weight map if it is sharded."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ValueError(f"checkpoint folder {str(root)!r} does not exist")
    index_path = root / _INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards = [root / name for name in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ValueError(f"{index_path} lists shard files that are missing: {absent}")
        return shards, weight_map
    if (root / _SINGLE_FILE).is_file():
        return [root / _SINGLE_FILE], None
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in checkpoint folder {str(root)!r}")
    return shards, None


def iter_safetensors_checkpoint(
    checkpoint_dir: str | Path, device: str | torch.device = "cpu", progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` shard by shard, so at most one shard is held at a time."""
    shards, weight_map = checkpoint_shards(checkpoint_dir)
    seen: set[str] = set()
    for shard in tqdm(shards, desc="Loading safetensors shards", disable=not progress):
        for name, tensor in load_file(str(shard), device=str(device)).items():
            seen.add(name)
            yield name, tensor
    if weight_map is not None and set(weight_map) - seen:
        missing = sorted(set(weight_map) - seen)
        raise ValueError(
            f"{len(missing)} weights listed in {_INDEX_FILE} are not in any shard: "
            f"{_preview(missing)}"
        )


def load_safetensors_checkpoint(
    checkpoint_dir: str | Path, device: str | torch.device = "cpu", progress: bool = True
) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded index)."""
    return dict(iter_safetensors_checkpoint(checkpoint_dir, device, progress))


def _preview(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_weights(expected: set[str], got: set[str], optional: Iterable[str] = ()) -> None:
    """Raise a ValueError naming missing and unexpected weights (a few names and the count)."""
    optional = set(optional)
    missing = expected - got - optional
    unexpected = got - expected - optional
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} weights: {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} weights: {_preview(unexpected)}")
    if any(n.endswith(_SCALE) for n in missing):
        problems.append(
            f"block-FP8 layers need their {_SCALE}; a layer the checkpoint stores in 16 bits "
            "must be listed in quantization_config.modules_to_not_convert"
        )
    if any(n.endswith(_SCALE) for n in unexpected):
        problems.append(
            f"{_SCALE} tensors for layers this model holds in 16 bits (listed in "
            "modules_to_not_convert, or the checkpoint's config has no quantization_config)"
        )
    if problems:
        raise ValueError("checkpoint does not match the model: " + "; ".join(problems))


def _split_fused(param_name: str, fused: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Our parameter name -> the HF names that fill it (itself when not fused)."""
    parts = param_name.split(".")
    if len(parts) >= 2 and parts[-2] in fused:
        return [".".join([*parts[:-2], src, parts[-1]]) for src in fused[parts[-2]]]
    return [param_name]


def load_hf_weights(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    *,
    rename: Callable[[str], str | None] | None = None,
    fused: Mapping[str, tuple[str, ...]] = FUSED_PROJECTIONS,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    optional: Iterable[str] = (),
) -> None:
    """Copy HF-named `weights` into `model`'s parameters.

    `rename` maps a checkpoint name onto the model's naming (None drops it), applied before
    the fused split; `ignore` are regexes of checkpoint names to drop; `optional` names (in
    the model's HF naming) may be absent, for example a tied `lm_head.weight`.
    """
    patterns = [re.compile(p) for p in ignore]
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        target = rename(name) if rename is not None else name
        if target is None or any(p.search(target) for p in patterns):
            continue
        renamed[target] = tensor
    params = dict(model.named_parameters(remove_duplicate=False))
    sources = {p: _split_fused(p, fused) for p in params}
    shards = _param_shards(model)
    expected = {hf for names in sources.values() for hf in names}
    blocks = _block_fp8_layers(model)
    optional = set(optional)
    for prefix, layer in blocks.items():
        if layer.quantize_on_load:  # 16-bit checkpoints carry no scales
            optional.update(sources[prefix + _SCALE])
    check_weights(expected, set(renamed), optional)
    with torch.no_grad():
        for prefix, layer in blocks.items():
            weight_names = sources.pop(prefix + "weight")
            scale_names = sources.pop(prefix + _SCALE)
            scales = [renamed[n] for n in scale_names if n in renamed]
            layer.load_fp8_block_shards(
                prefix + "weight",
                _take(shards.get(prefix + "weight"), [renamed[n] for n in weight_names]),
                _take(shards.get(prefix + _SCALE), scales) if scales else None,
            )
        for param_name, hf_names in sources.items():
            present = [renamed[n] for n in hf_names if n in renamed]
            if not present:
                continue  # an optional weight (tied head) left out of the checkpoint
            parts = shards.get(param_name)
            if parts is not None and len(parts) == len(present):  # else _copy_into names it
                present = _take(parts, present)
            _copy_into(params[param_name], param_name, [materialize(v) for v in present], hf_names)


def _take(parts: tuple[AnyShard | None, ...] | None, tensors: list[Any]) -> list[Any]:
    """This rank's slice of each checkpoint part (all of a part without a shard); as given
    when the counts differ (the caller's check names the mismatch)."""
    if parts is None or len(parts) != len(tensors):
        return [materialize(t) for t in tensors]
    return [
        materialize(s.take(t) if s is not None else t) for s, t in zip(parts, tensors, strict=True)
    ]


def _param_shards(model: nn.Module) -> dict[str, tuple[AnyShard | None, ...]]:
    """Parameter name -> one checkpoint slice per source part, for modules built for one
    tensor-parallel rank (their `tp_shards`); empty for an unsharded model."""
    out: dict[str, tuple[AnyShard | None, ...]] = {}
    for name, module in model.named_modules():
        for local, parts in (getattr(module, "tp_shards", None) or {}).items():
            out[f"{name}.{local}" if name else local] = parts
    return out


def _block_fp8_layers(model: nn.Module) -> dict[str, Any]:
    """Block-FP8 `Linear`s (`Linear.to_fp8_block_`) by parameter-name prefix ("" or "a.b.")."""
    return {
        (name + "." if name else ""): module
        for name, module in model.named_modules()
        if getattr(module, "fp8_block", None) is not None
    }


def _copy_into(
    param: torch.Tensor, name: str, shards: list[torch.Tensor], hf_names: list[str]
) -> None:
    if param.is_meta:
        raise ValueError(f"parameter {name!r} is still on the meta device; materialise first")
    if len(shards) != len(hf_names):
        raise ValueError(f"{name!r} needs all of {hf_names}, got {len(shards)} of them")
    fp8 = {s.dtype in _FP8_DTYPES for s in shards}
    if fp8 != {param.dtype in _FP8_DTYPES}:
        raise ValueError(
            f"{name!r} (from {hf_names}) is {param.dtype} in the model but the checkpoint has "
            f"{sorted({str(s.dtype) for s in shards})}: FP8 tensors are never loaded as 16-bit "
            "ones (or the reverse); check quantization_config.modules_to_not_convert"
        )
    value = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
    if value.shape != param.shape:
        raise ValueError(
            f"shape mismatch for {name!r} (from {hf_names}): checkpoint "
            f"{tuple(value.shape)} vs model {tuple(param.shape)}"
        )
    param.copy_(value)


def materialize_meta_model(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Give every meta parameter real (uninitialised) storage on `device`, keeping its dtype.

    NOTE: shared Parameters (tied embeddings) stay shared. Buffers with values move to
    `device`; modules whose buffers are still on meta rebuild them in `init_buffers(device)`.
    """
    device = torch.device(device)
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in memo:
                data = torch.empty_like(param, device=device) if param.is_meta else param.to(device)
                memo[id(param)] = nn.Parameter(data, requires_grad=False)
            module._parameters[name] = memo[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers(device)
    still_meta = [n for n, b in model.named_buffers() if b.is_meta]
    if still_meta:
        raise ValueError(
            f"buffers left on the meta device (build them with an explicit device or define "
            f"init_buffers(device) on their module): {_preview(still_meta)}"
        )
    return model


def build_model_on_meta(
    cls: Callable[[Any], nn.Module],
    model_config: Any,
    device: str | torch.device,
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Construct `cls(model_config)` without allocating weights, then materialise on `device`.

    `prepare(model)` runs while the model is still on meta (block-FP8: switch linears to
    e4m3 before any storage exists). The parameters hold garbage until
    `model.load_weights(...)` fills them.
    """
    with torch.device("meta"):
        model = cls(model_config)
        if prepare is not None:
            prepare(model)
    return materialize_meta_model(model, device).eval()


def load_model(
    cls: Callable[[Any], nn.Module],
    model_config: Any,
    device: str | torch.device,
    checkpoint_dir: str | Path | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Build on meta (`prepare` as in build_model_on_meta), then load the safetensors
    checkpoint (default: `checkpoint_dir` of `model_config`)."""
    checkpoint_dir = checkpoint_dir or getattr(model_config, "checkpoint_dir", None)
    if checkpoint_dir is None:
        raise ValueError("load_model needs a checkpoint_dir (or model_config.checkpoint_dir)")
    model = build_model_on_meta(cls, model_config, device, prepare)
    mapping = getattr(model_config, "mapping", None)
    if mapping is not None and mapping.has_tp:
        files, _ = checkpoint_shards(checkpoint_dir)
        model.load_weights(lazy_safetensors_checkpoint(files))  # type: ignore[operator]
    else:
        model.load_weights(load_safetensors_checkpoint(checkpoint_dir))  # type: ignore[operator]
    return model
