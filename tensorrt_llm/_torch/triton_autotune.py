"""Triton autotuners of the GPU path (fla's chunk kernels): bounded keys and a disk cache.

`triton.autotune` benchmarks every config the first time it sees a new tuning key (the values of
its `key=` arguments plus the dtypes of the tensors). A key that reads an unbounded dimension
(a token count `T`, a chunk count `NT`, ...) would re-tune for every new prompt length, inside a
served step. `install_bucketed_caches` swaps each autotuner's result dict for a
`BucketedConfigCache`, which rounds those dimensions up to a power of two before the lookup, so
the finite warm-up (`pyexecutor/warmup.py`) tunes every key a step can produce. A config is only
a speed choice; any config of the list computes the same result (up to float rounding), so
sharing one across a bucket is safe. (fla 0.6's forward kernels key on head dims and chunk
sizes, plus `B` and l2norm's `NB`, both 1 here: they tune once per model and dtype.)

`AutotuneDiskCache` stores the tuned configs of every autotuner as JSON, in one file per
fingerprint (GPU name and compute capability, torch / triton / fla / tensorrt_llm versions), so a
second start reads them instead of benchmarking. Triton's own `cache_results` (which fla 0.6
turns on unless FLA_CACHE_RESULTS=0, in Triton's cache directory) is not relied on: its key has
the GPU architecture but not the GPU's name (an H100 and an H200 would share results), and it is
per autotuner opt-in. Ours is read before the first forward, so a warm start asks neither.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Autotune key arguments that grow with the step (tokens, chunks, sequences): bucketed.
UNBOUNDED_KEY_NAMES = frozenset({"T", "NT", "N", "NB", "B"})
# Modules whose autotuners the engine manages (fla's kernels; ours do not autotune).
AUTOTUNED_MODULE_PREFIXES = ("fla.",)
ENV_CACHE_DIR = "TRTLLM_CACHE_DIR"

NewKeyHook = Callable[[str, tuple[Any, ...]], None]


def bucket_dim(value: Any) -> Any:
    """Positive ints -> the next power of two (1, 2, 4, 8, ...); anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
        return value
    return 1 << (value - 1).bit_length()


class BucketedConfigCache(dict):  # type: ignore[type-arg]
    """An `Autotuner.cache` whose keys have their unbounded positions bucketed.

    Triton reads it with `key in cache`, `cache[key]` and writes `cache[key] = best`; each write
    of a key not seen before is a finished benchmark (or a config Triton's or fla's own caches
    supplied on first use), reported to `on_new_key` (the step compile guard) and counted in
    `num_benchmarked`.
    """

    def __init__(self, kernel: str, positions: Iterable[int]) -> None:
        super().__init__()
        self.kernel = kernel
        self.positions = frozenset(positions)
        self.num_benchmarked = 0
        self.on_new_key: NewKeyHook | None = None

    def normalize(self, key: Any) -> Any:
        if not isinstance(key, tuple) or not self.positions:
            return key
        return tuple(bucket_dim(v) if i in self.positions else v for i, v in enumerate(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self.normalize(key))

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(self.normalize(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self.normalize(key), default)

    def pop(self, key: Any, *default: Any) -> Any:  # fla drops a rejected cached config
        return super().pop(self.normalize(key), *default)

    def __setitem__(self, key: Any, value: Any) -> None:
        norm = self.normalize(key)
        fresh = not super().__contains__(norm)
        super().__setitem__(norm, value)
        if fresh:
            self.num_benchmarked += 1
            if self.on_new_key is not None:
                self.on_new_key(self.kernel, norm)

    def preload(self, key: tuple[Any, ...], value: Any) -> None:
        """An entry read from disk: stored without counting or reporting it."""
        super().__setitem__(self.normalize(key), value)


def _unwrap(obj: Any) -> Any:
    """The Autotuner inside `triton.heuristics` wrappers, or None."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    for _ in range(8):  # Heuristics(Autotuner(JITFunction)) nests a few levels at most
        if isinstance(obj, Autotuner):
            return obj
        if not isinstance(obj, KernelInterface):  # only Triton's wrappers are walked
            return None
        obj = getattr(obj, "fn", None)
    return None


def kernel_name(tuner: Any) -> str:
    """`module.qualname` of the Python function an autotuner wraps."""
    fn = tuner.base_fn
    return f"{fn.__module__}.{fn.__qualname__}"


def find_autotuners(prefixes: tuple[str, ...] = AUTOTUNED_MODULE_PREFIXES) -> dict[str, Any]:
    """Every Autotuner reachable as a module attribute of an imported module under `prefixes`."""
    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            tuner = _unwrap(value)
            if tuner is not None:
                found[kernel_name(tuner)] = tuner
    return found


def install_bucketed_caches(tuners: dict[str, Any]) -> dict[str, BucketedConfigCache]:
    """Give each autotuner a BucketedConfigCache (idempotent; existing entries carried over)."""
    caches: dict[str, BucketedConfigCache] = {}
    for name, tuner in tuners.items():
        cache = tuner.cache
        if not isinstance(cache, BucketedConfigCache):
            positions = [i for i, k in enumerate(tuner.keys) if k in UNBOUNDED_KEY_NAMES]
            new = BucketedConfigCache(name, positions)
            for key, value in cache.items():
                new.preload(key, value)
            tuner.cache = cache = new
        caches[name] = cache
    return caches


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _fla_version() -> str:
    version = _version("fla-core")
    if version == "none":  # a checkout on PYTHONPATH has no distribution metadata
        version = str(getattr(sys.modules.get("fla"), "__version__", "none"))
    return version


def fingerprint(gpu_name: str, capability: tuple[int, int]) -> dict[str, str]:
    """What tuned configs depend on besides the kernel and its key."""
    import torch
    import triton

    from .. import __version__

    return {
        "gpu": gpu_name,
        "capability": f"{capability[0]}.{capability[1]}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": _fla_version(),
        "tensorrt_llm": __version__,
    }


def default_cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join("~", ".cache", "tensorrt_llm")
    return Path(root).expanduser() / "autotune"


def _config_fields(config: Any) -> dict[str, Any]:
    return {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": config.num_ctas,
        "maxnreg": config.maxnreg,
    }


def _json_key(key: Any) -> list[Any] | None:
    """The key as a JSON list, or None when a value would not read back equal."""
    if not isinstance(key, tuple):
        return None
    ok = all(isinstance(v, (int, float, str, bool)) or v is None for v in key)
    return list(key) if ok else None


class AutotuneDiskCache:
    """Tuned configs of every autotuner, one JSON file per fingerprint under `directory`."""

    def __init__(self, directory: Path, print_: dict[str, str]) -> None:
        self.fingerprint = dict(print_)
        digest = hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(directory) / f"{digest}.json"

    def _read(self) -> dict[str, list[Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a torn or foreign file: tune again, say so
            logger.warning("autotune cache %s unreadable (%s); re-tuning", self.path, exc)
            return {}
        if data.get("fingerprint") != self.fingerprint:
            logger.warning("autotune cache %s has another fingerprint; re-tuning", self.path)
            return {}
        return dict(data.get("kernels", {}))

    def load_into(self, tuners: dict[str, Any], caches: dict[str, BucketedConfigCache]) -> int:
        """Preload the stored configs; returns how many entries were loaded. An entry whose
        config is no longer in the kernel's list (fla changed its configs) is skipped."""
        loaded = 0
        for name, entries in self._read().items():
            tuner, cache = tuners.get(name), caches.get(name)
            if tuner is None or cache is None:
                continue
            by_fields = {json.dumps(_config_fields(c), sort_keys=True): c for c in tuner.configs}
            for key, fields in entries:
                config = by_fields.get(json.dumps(fields, sort_keys=True))
                if config is not None:
                    cache.preload(tuple(key), config)
                    loaded += 1
        return loaded

    def save_from(self, caches: dict[str, BucketedConfigCache]) -> int:
        """Write every tuned entry (atomically: a concurrent reader sees old or new, whole).
        An entry whose key has a value JSON cannot hold is left out, with a warning."""
        kernels: dict[str, list[Any]] = {}
        for name, cache in caches.items():
            for key, config in cache.items():
                stored = _json_key(key)
                if stored is None:
                    logger.warning("autotune cache: %s key %r not storable; skipped", name, key)
                    continue
                kernels.setdefault(name, []).append([stored, _config_fields(config)])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "kernels": kernels}))
        os.replace(tmp, self.path)
        return sum(len(v) for v in kernels.values())
