"""The GPU path's Triton kernel variants compile to sm_90 cubins, checked on any machine.

The CPU tests run the kernels under Triton's interpreter, which accepts code the GPU compiler
rejects (and the reverse); this compiles the launched variants for Hopper with Triton's bundled
ptxas, in a subprocess without TRITON_INTERPRET (see hopper_compile.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _has_ptxas() -> bool:
    from triton.backends.nvidia import compiler  # noqa: F401  (import fails without the backend)

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_ptxas(), reason="this triton install ships no ptxas")
def test_kernel_variants_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier cache
    repo = Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("hopper_compile.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert len([line for line in lines if line.startswith("ok ")]) >= 18, proc.stdout
