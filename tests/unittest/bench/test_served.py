"""trtllm-bench --served on CPU with real processes: a trtllm-serve child, or --served_url.

Every run checks that the rows count what was asked (requests x osl tokens, prompts of isl
tokens as the server counts them) and that no server process outlives the benchmark.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tensorrt_llm.bench.served import (
    STAGE_COLUMNS,
    parse_served_url,
    queue_note,
    server_seq_slots,
    single_token_words,
)
from tensorrt_llm.bench.server_process import ServerProcess
from tensorrt_llm.bench.workload import prepare_model_folder
from tensorrt_llm.commands.bench import main, parse_args, serve_flags
from tensorrt_llm.commands.serve import llm_kwargs
from tensorrt_llm.commands.serve import parse_args as serve_parse_args
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict
from tensorrt_llm.tools.tiny_tokenizer import SPECIAL_IDS

ISL, OSL = 60, 4
_TINY = ["--isl", str(ISL), "--osl", str(OSL), "--image_size", "32", "--dtype", "float32"]
_TINY += ["--device", "cpu", "--concurrency", "1", "2"]


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(build_config_dict("qwen3_vl")))
    return path


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the child ran in a session of its own)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return sorted(members)


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    if sys.platform.startswith("linux"):
        # A SIGKILLed grandchild can stay listed for a moment while the kernel tears it down
        # (seen under the full suite's load): give it a few seconds, not forever.
        deadline = time.monotonic() + 5.0
        while _group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group_members(pid) == [], "a process the server started outlived it"


def _child_pid(stdout: str) -> int:
    match = re.search(r"trtllm-serve child pid (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


def _check_rows(rows: list[dict[str, float]]) -> None:
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        assert row["requests"] == 2  # one wave, at least 2 requests
        assert row["output_tokens"] == row["requests"] * OSL  # ignore_eos: exactly osl each
        assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        assert 0 < row["ttft_ms_p50"] <= row["latency_ms_p50"]
        assert row["ttft_ms_p99"] <= row["latency_ms_p99"]
        assert row["itl_ms_p50"] > 0 and row["per_user_tok_s"] > 0


def test_served_child_and_in_process_side_by_side(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["--config", str(tiny_config), *_TINY, "--served", "--inprocess_too"]
    assert main([*argv, "--output", str(out)]) == 0
    pid = _child_pid(capsys.readouterr().out)
    _assert_gone(pid)
    result = json.loads(out.read_text())
    _check_rows(result["served"])
    _check_rows(result["ours"])
    # The server's own count of every prompt: chat template and vision tokens included.
    assert all(r["isl_mean"] == ISL for r in result["served"])
    for row in result["served"]:  # the server's time per stage before the first token
        stages = [row[c] for c in STAGE_COLUMNS]
        # parse, media, prepare, first_token follow each other; the engine's two split the
        # last (plus the end of prepare, where the engine request is built).
        assert all(t > 0 for t in stages[:4]) and all(t >= 0 for t in stages[4:]), stages
        assert sum(stages[:4]) <= row["ttft_ms_p99"]
        assert sum(stages[4:]) <= stages[2] + stages[3] + 1e-6
        assert row["server_cpu_pct"] > 0.0  # the child's own CPU over the wave
        assert row["server_seq_slots"] >= row["concurrency"]  # the server's own count
    ratios = result["served_vs_inprocess"]
    assert [r["concurrency"] for r in ratios] == [1, 2]
    for ratio, served, ours in zip(ratios, result["served"], result["ours"], strict=True):
        assert ratio["output_tok_s_ratio"] == pytest.approx(
            served["output_tok_s"] / ours["output_tok_s"]
        )


def test_served_url_uses_the_running_server(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = prepare_model_folder(tiny_config, tmp_path / "model", 32)
    flags = serve_flags(parse_args(["--config", str(tiny_config), *_TINY]), folder)
    server = ServerProcess(flags, tmp_path / "serve.log")
    try:
        server.wait_ready(120)
        out = tmp_path / "result.json"
        url = f"http://{server.host}:{server.port}"
        argv = ["--config", str(tiny_config), *_TINY, "--served_url", url, "--output", str(out)]
        assert main(argv) == 0
        assert "child pid" not in capsys.readouterr().out  # no server of its own
        assert server.proc.poll() is None  # and it left ours running
        result = json.loads(out.read_text())
        assert "ours" not in result
        _check_rows(result["served"])
        assert all(r["isl_mean"] == ISL for r in result["served"])
    finally:
        server.stop()
    _assert_gone(server.pid)


def test_child_is_stopped_when_the_benchmark_fails(
    tiny_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # isl 5 cannot hold the chat template and an image: the probe fails after the start.
    # (osl 40 keeps max_seq_len = isl + osl + 8 roomy enough for the engine's startup.)
    argv = ["--config", str(tiny_config), *_TINY, "--served", "--isl", "5", "--osl", "40"]
    with pytest.raises(ValueError, match="leaves no room for text"):
        main(argv)
    _assert_gone(_child_pid(capsys.readouterr().out))


def test_stop_kills_a_server_that_ignores_sigint(tmp_path: Path) -> None:
    # A stand-in server: ignores SIGINT and leaves a grandchild behind; stop() must take both.
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "log"
    server = ServerProcess([], log, command=(sys.executable, "-c", script))
    try:
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGINT must arrive after the stand-in started ignoring it
        grandchild = int(log.read_text().split()[1])
        assert _group_members(server.pid) == sorted([server.pid, grandchild])
        start = time.monotonic()
    finally:
        assert server.stop(timeout=1.0) == -signal.SIGKILL
    assert time.monotonic() - start >= 1.0  # SIGINT was tried first, for the whole timeout
    _assert_gone(server.pid)


def test_serve_flags_leave_server_defaults_alone(tiny_config: Path, tmp_path: Path) -> None:
    args = parse_args(["--config", str(tiny_config), *_TINY, "--served"])
    flags = serve_flags(args, tmp_path)
    assert flags[0] == str(tmp_path)
    pairs = dict(zip(flags[1::2], flags[2::2], strict=True))
    assert pairs["--load_format"] == "dummy" and pairs["--max_seq_len"] == str(ISL + OSL + 8)
    assert pairs["--dtype"] == "float32" and pairs["--device"] == "cpu"
    for unset in ("--max_batch_size", "--max_num_tokens", "--kv_cache_free_gpu_memory_fraction"):
        assert unset not in flags
    given = parse_args(
        ["--config", str(tiny_config), *_TINY, "--max_batch_size", "64", "--stream_interval", "4"]
    )
    given_flags = serve_flags(given, tmp_path)
    given_pairs = dict(zip(given_flags[1::2], given_flags[2::2], strict=True))
    assert given_pairs["--max_batch_size"] == "64" and given_pairs["--stream_interval"] == "4"
    # The mapped flags are ones trtllm-serve accepts, and reach LLM(...).
    kwargs = llm_kwargs(serve_parse_args(given_flags))
    assert kwargs["load_format"] == "dummy" and kwargs["max_batch_size"] == 64
    assert kwargs["stream_interval"] == 4
    with pytest.raises(SystemExit, match="no CUDA-graph flags"):
        serve_flags(parse_args(["--config", str(tiny_config), "--no_cuda_graph"]), tmp_path)


def test_serve_args_reach_the_child(tiny_config: Path, tmp_path: Path) -> None:
    base = ["--config", str(tiny_config), *_TINY]
    args = parse_args([*base, "--served", "--serve_args", "--num_preprocess_workers 3"])
    flags = serve_flags(args, tmp_path)
    assert flags[-2:] == ["--num_preprocess_workers", "3"]
    assert serve_parse_args(flags).num_preprocess_workers == 3
    for bad in (["--serve_args", "--x 1"], ["--served_url", "http://h:1", "--serve_args", "--x"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])


def test_served_url_parsing() -> None:
    assert parse_served_url("http://127.0.0.1:8123") == ("127.0.0.1", 8123)
    assert parse_served_url("http://localhost:8000/v1/") == ("localhost", 8000)
    for bad in ("https://h:1", "127.0.0.1:8000", "http://h:1/v1/chat/completions"):
        with pytest.raises(ValueError, match="--served_url"):
            parse_served_url(bad)
    with pytest.raises(SystemExit):
        parse_args(["--config", "x.json", "--inprocess_too"])  # needs --served


def test_every_model_id_decodes_to_text(tmp_path: Path) -> None:
    # Regression: the tiny tokenizer knew ~400 of a real config's ids; the rest decoded to ""
    # and a served stream of random-weight tokens carried (almost) no text chunks.
    from transformers import AutoTokenizer

    cfg = build_config_dict("qwen3_vl")
    cfg["text_config"]["vocab_size"] = 5000
    (tmp_path / "big.json").write_text(json.dumps(cfg))
    folder = prepare_model_folder(tmp_path / "big.json", tmp_path / "m", 32)
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == 5000
    specials = set(SPECIAL_IDS.values())
    for token_id in range(5000):
        text = tok.decode([token_id], skip_special_tokens=True)
        assert (text == "") == (token_id in specials), token_id
    for token, token_id in SPECIAL_IDS.items():  # the placeholders keep the config's ids
        assert tok.convert_tokens_to_ids(token) == token_id
    # Encoding is unchanged: prompt words stay single tokens.
    words = single_token_words(folder / "tokenizer.json")
    assert "the" in words and all(len(tok.encode(" " + w)) == 1 for w in words)


def test_chat_body_carries_the_guided_schema() -> None:
    from types import SimpleNamespace

    from tensorrt_llm.bench.served import chat_body

    target = SimpleNamespace(model="m")
    plain = json.loads(chat_body(target, [], 8, True))  # type: ignore[arg-type]
    assert "response_format" not in plain
    guided = json.loads(chat_body(target, [], 8, False, '{"type": "object"}'))  # type: ignore[arg-type]
    fmt = guided["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == {"type": "object"}


def test_block_reuse_and_policy_flags(tiny_config: Path, tmp_path: Path) -> None:
    from tensorrt_llm.commands.bench import _policy_kwargs

    base = ["--config", str(tiny_config), *_TINY]
    off = parse_args([*base, "--no-enable_block_reuse", "--served"])
    flags = serve_flags(off, tmp_path)
    assert "--no-enable_block_reuse" in flags
    assert llm_kwargs(serve_parse_args(flags))["enable_block_reuse"] is False
    assert "--enable_block_reuse" in serve_flags(
        parse_args([*base, "--enable_block_reuse"]), tmp_path
    )
    assert not {"--enable_block_reuse", "--no-enable_block_reuse"} & set(
        serve_flags(parse_args(base), tmp_path)
    )
    policy = parse_args([*base, "--capacity_scheduler_policy", "GUARANTEED_NO_EVICT"])
    assert _policy_kwargs(policy) == {
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    }
    assert _policy_kwargs(off) == {"kv_cache_config": {"enable_block_reuse": False}}
    with pytest.raises(SystemExit, match="in process only"):
        serve_flags(policy, tmp_path)


def test_the_server_seq_slots_and_the_queue_note() -> None:
    """`server_seq_slots` reads the server's own /metrics exposition; a wave larger than
    the slots gets a line saying how many of it queue, a wave within them none."""
    from types import SimpleNamespace

    from tensorrt_llm.serve.metrics import ServerMetrics, parse_prometheus

    stats = SimpleNamespace(num_total_seq_slots=62, num_free_seq_slots=62)
    samples = parse_prometheus(ServerMetrics("m", stats_fn=lambda: stats).render())
    assert server_seq_slots(samples) == 62
    assert server_seq_slots(parse_prometheus(ServerMetrics("m").render())) != 62  # nan
    note = queue_note(128, server_seq_slots(samples))
    assert note is not None and "at most 62 requests" in note and "66 of the c=128" in note
    assert queue_note(62, 62.0) is None and queue_note(128, float("nan")) is None
