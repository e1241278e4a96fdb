"""`benchmarks/bench_moe.py`'s block-FP8 tile sweep, dry-run on the CPU (Triton's interpreter,
tiny sizes, a stand-in timer), so a broken sweep shows here and not on the lent GPU.

The sweep must time the table's tiles next to the candidates, check every candidate's output
against the first layout's (a tile that computes wrong is no choice), and name the table's
figure and the best pair per BLOCK_M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import json, sys
sys.path.insert(0, "benchmarks")
import bench_moe as bm
bm.DEVICE = "cpu"
bm.H, bm.E, bm.INTER, bm.TOP_K = 256, 8, 128, 2
bm._DECODE_GATE_UP = ((16, 32, 4, 4), (32, 64, 4, 3))
bm._DECODE_DOWN = ((16, 64, 4, 3), (32, 128, 4, 3))
calls = []
def fake_time(fn, iters=50):
    fn()
    calls.append(1)
    return float(len(calls))
bm.graph_time_us = fake_time
row = bm.block_fp8((5,))[0]
print(json.dumps({"table": row["table tiles"], "us": row["us"], "best": row["best us by BLOCK_M"]}))
"""


def test_block_fp8_sweep_times_the_table_and_the_candidates() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 5 tokens: the table's <= 64 bucket, BLOCK_M 16, 4 stages, for both kernels.
    assert got["table"] == [[16, 64, 4, 4], [16, 64, 4, 4]]
    names = set(got["us"])
    assert {"gate_up 16/64/4/4", "gate_up 16/32/4/4", "gate_up 32/64/4/3"} <= names
    for cfg in ("16/64/4/4", "16/64/4/3", "32/128/4/3"):
        assert {f"down {cfg} sum", f"down {cfg} atomic"} <= names
    assert set(got["best"]) == {"16", "32"}
