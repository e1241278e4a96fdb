"""The step compile guard: Triton compiles and autotune benchmarks seen after warm-up.

After warm-up (`pyexecutor/warmup.py`) no served step should compile a Triton kernel or
benchmark an autotuner: either stalls every request of the step (a compile ~0.3 s, an fla
autotune seconds). With `TRTLLM_FAIL_ON_STEP_COMPILE=1` one that happens on an armed thread (the
executor's loop thread, armed once warm-up is done) raises `StepCompileError` naming the kernel
and its specialization or tuning key, so the step's requests fail with that message and the
engine keeps serving; the GPU tests use it to prove warm-up covers every shape.

Detection uses Triton's documented `knobs.runtime.jit_cache_hook` (called before each compile,
never on a launch that hits the in-memory kernel cache) and the autotuners' result dicts
(`triton_autotune.BucketedConfigCache` reports each newly tuned key). Both paths run only when
something compiles or tunes, so a steady step pays nothing, flag on or off. Without the flag the
guard only counts (warm-up's log line).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

ENV_FAIL_ON_STEP_COMPILE = "TRTLLM_FAIL_ON_STEP_COMPILE"


class StepCompileError(RuntimeError):
    """A Triton compile or autotune benchmark inside a served step (the debug flag is on)."""


def fail_on_step_compile() -> bool:
    return os.environ.get(ENV_FAIL_ON_STEP_COMPILE, "0") not in ("", "0")


class StepCompileGuard:
    """Counts compiles and autotune benchmarks; raises on armed threads when `fail` is set."""

    def __init__(self) -> None:
        self._armed: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._installed = False
        self._chained: Any = None
        self.num_compiles = 0
        self.num_autotunes = 0

    @property
    def fail(self) -> bool:
        # Read per event (events are rare), so a test can set the variable after import.
        return fail_on_step_compile()

    def arm(self, thread: threading.Thread) -> None:
        """From now on, compiles on `thread` are served-step compiles."""
        with self._lock:
            self._armed.add(thread)

    def disarm(self, thread: threading.Thread) -> None:
        with self._lock:
            self._armed.discard(thread)

    def _check(self, what: str) -> None:
        if self.fail and threading.current_thread() in self._armed:
            raise StepCompileError(
                f"{what} inside a served step, after warm-up ({ENV_FAIL_ON_STEP_COMPILE}=1): "
                "the warm-up does not cover this shape"
            )

    def on_jit_compile(self, **kwargs: Any) -> bool:
        """`triton.knobs.runtime.jit_cache_hook`: False lets Triton compile as usual."""
        self.num_compiles += 1
        # `key` is Triton's specialization key: argument types, divisibility, constexprs.
        self._check(f"Triton JIT compile of {kwargs.get('repr', '?')} (key {kwargs.get('key')})")
        if self._chained is not None:
            return bool(self._chained(**kwargs))
        return False

    def on_autotune(self, kernel: str, key: tuple[Any, ...]) -> None:
        """`BucketedConfigCache.on_new_key`: an autotuner just benchmarked a new key."""
        self.num_autotunes += 1
        self._check(f"Triton autotune benchmark of {kernel} for key {key}")

    def install(self) -> None:
        """Hook into Triton once per process (an existing jit_cache_hook is chained)."""
        if self._installed:
            return
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing can compile
            return
        current = knobs.runtime.jit_cache_hook
        if current is not self.on_jit_compile:
            self._chained = current
            knobs.runtime.jit_cache_hook = self.on_jit_compile
        self._installed = True


# One per process: Triton's hook is process-wide, and so are its compiled kernels.
STEP_COMPILE_GUARD = StepCompileGuard()
