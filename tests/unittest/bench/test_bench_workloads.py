"""trtllm-bench --multi_turn and --max_tokens_dist: the workloads as pure functions, then real
runs on the tiny random checkpoint on CPU, in process (LLM API) and served (trtllm-serve)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.bench.early_stop import draw_stops, run_early_stop_llm
from tensorrt_llm.bench.metrics import RequestTiming
from tensorrt_llm.bench.multi_turn import (
    TurnSample,
    make_conversations,
    run_row,
    summarize_turns,
    turn_messages,
)
from tensorrt_llm.bench.multi_turn_run import MultiTurnSpec, llm_conversations, run_multi_turn_llm
from tensorrt_llm.bench.runner import sampling_params
from tensorrt_llm.bench.served import single_token_words
from tensorrt_llm.bench.server_process import ServerProcess
from tensorrt_llm.bench.sse_client import get_body, post_stream
from tensorrt_llm.bench.workload import Workload, make_requests, prepare_model_folder
from tensorrt_llm.commands.bench import main, parse_args, serve_flags
from tensorrt_llm.llmapi.outputs import RequestOutput
from tensorrt_llm.serve.metrics import parse_prometheus
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict

ISL, OSL, TURNS, TURN_TOKENS = 60, 4, 3, 10
_TINY = ["--isl", str(ISL), "--osl", str(OSL), "--image_size", "32", "--dtype", "float32"]
_TINY += ["--device", "cpu", "--concurrency", "2"]
_MULTI = ["--multi_turn", str(TURNS), "--turn_tokens", str(TURN_TOKENS)]


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(build_config_dict("qwen3_vl")))
    return path


# ---- pure functions ------------------------------------------------------------------------------
def test_turn_k_resends_the_history_with_the_image_and_the_answers() -> None:
    image = {"type": "image", "image": object()}
    conv = make_conversations([[image]], ["x", "y", "z"], 5, 3, turns=3)[0]
    assert len(conv.first_text.split()) == 5 and [len(q.split()) for q in conv.questions] == [3, 3]
    first = turn_messages(conv, [])
    assert first == [
        {"role": "user", "content": [image, {"type": "text", "text": conv.first_text}]}
    ]
    third = turn_messages(conv, ["answer one", "answer two"])
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[0] == first[0]  # turn 1's message, its image included, comes back unchanged
    assert third[1]["content"] == "answer one" and third[3]["content"] == "answer two"
    assert third[2]["content"] == conv.questions[0] and third[4]["content"] == conv.questions[1]
    assert turn_messages(conv, ["answer one"]) == third[:3]  # turn k's prefix is turn k-1's
    with pytest.raises(ValueError, match="has 3 turns"):
        turn_messages(conv, ["a", "b", "c"])
    # Seeded: the same conversations every run.
    again = make_conversations([[image]], ["x", "y", "z"], 5, 3, turns=3)[0]
    assert again == conv


def test_turn_rows_count_requests_and_the_hit_rate() -> None:
    def sample(turn: int, prompt: int, cached: int) -> TurnSample:
        return TurnSample(turn, RequestTiming(0.0, 0.01 * turn, 0.1, 4), prompt, cached)

    samples = [sample(1, 60, 0), sample(1, 60, 0), sample(2, 100, 50), sample(2, 120, 90)]
    rows = summarize_turns(samples, concurrency=2)
    assert [(r["turn"], r["requests"]) for r in rows] == [(1, 2), (2, 2)]
    assert rows[0]["prefix_hit_rate"] == 0.0 and rows[1]["prefix_hit_rate"] == 140 / 220
    assert rows[1]["prompt_tokens_mean"] == 110 and rows[1]["ttft_ms_p50"] == pytest.approx(20.0)


def test_run_row_pools_the_later_turns_ttft() -> None:
    """Turns 2.. pooled: the p50 of all their requests, not a mean of per-turn p50s (turn 2 of
    30 ms and turns 3, 4 of 10 ms pool to 10 ms; the per-turn mean would be 16.7)."""

    def sample(turn: int, ttft_ms: float) -> TurnSample:
        return TurnSample(turn, RequestTiming(0.0, ttft_ms / 1e3, 0.1, 4), 100, 50)

    samples = [sample(1, 90.0), sample(2, 30.0), sample(3, 10.0), sample(4, 10.0)]
    row = run_row(samples, wall=1.0, concurrency=1, peak=None)
    assert row["later_turns_ttft_ms_p50"] == pytest.approx(10.0)
    assert "later_turns_ttft_ms_p50" not in run_row(samples[:1], 1.0, 1, None)


def test_stop_draws_are_seeded_and_within_bounds() -> None:
    stops = draw_stops(3, 8, 500, seed=0)
    assert stops == draw_stops(3, 8, 500, seed=0) != draw_stops(3, 8, 500, seed=1)
    assert min(stops) == 3 and max(stops) == 8  # both ends inclusive
    with pytest.raises(ValueError, match="LO <= HI"):
        draw_stops(5, 4, 1)


def test_request_output_has_a_cached_token_count() -> None:
    out = RequestOutput(1, None, [1, 2, 3], [], num_cached_tokens=2)
    assert RequestOutput(1, None, [1], []).num_cached_tokens == 0  # no prefix cache yet
    assert out.snapshot().num_cached_tokens == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max_tokens_dist", "2", "3"], "do not combine"),
        (["--guided_json", "s.json"], "does not support --guided_json"),
        (["--hf_baseline"], "does not support --hf_baseline"),
        (["--num_requests", "4"], "--num_requests does not apply"),
        (["--multi_turn", "0"], ">= 1"),
    ],
)
def test_flag_combinations_that_make_no_sense(
    tiny_config: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tiny_config), *_TINY, *_MULTI, *extra])
    assert message in capsys.readouterr().err


def test_max_tokens_dist_must_fit_the_osl(
    tiny_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tiny_config), *_TINY, "--max_tokens_dist", "2", "5"])
    assert "HI <= --osl" in capsys.readouterr().err
    args = parse_args(["--config", str(tiny_config), *_TINY, "--max_tokens_dist", "2", "4"])
    assert args.max_tokens_dist == [2, 4]


# ---- in process ----------------------------------------------------------------------------------
def _check_turn_rows(rows: list[dict[str, float]]) -> None:
    assert [(r["turn"], r["requests"]) for r in rows] == [(k, 2) for k in range(1, TURNS + 1)]
    assert rows[0]["prompt_tokens_mean"] == ISL  # turn 1 is sized to the isl
    for before, after in zip(rows, rows[1:], strict=False):
        # The whole history again, plus an answer and a new question of TURN_TOKENS.
        assert after["prompt_tokens_mean"] >= before["prompt_tokens_mean"] + TURN_TOKENS + OSL
    for row in rows:
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] <= row["latency_ms_p50"] * 10
    # Prefix caching is on by default: turn 1 (fresh conversations) misses, every later turn
    # resends a history whose head is cached.
    assert rows[0]["prefix_hit_rate"] == 0.0
    assert all(0 < row["prefix_hit_rate"] < 1 for row in rows[1:])


def test_multi_turn_in_process(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    assert main(["--config", str(tiny_config), *_TINY, *_MULTI, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["ours"][0]
    assert run["requests"] == 2 * TURNS and run["output_tokens"] == 2 * TURNS * OSL
    assert run["peak_running"] >= 1
    _check_turn_rows(result["ours_turns"])


class _Recorder:
    """An LLM stand-in that forwards to the real one and keeps every prompt and handle."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.calls: list[tuple[Any, Any]] = []

    def generate_async(self, prompt: Any, params: Any, streaming: bool = False) -> Any:
        handle = self.llm.generate_async(prompt, params, streaming=streaming)
        self.calls.append((prompt, handle))
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


def test_llm_turns_carry_the_answers_and_early_stops_free_the_engine(
    tiny_config: Path, tmp_path: Path
) -> None:
    from tensorrt_llm.llmapi.llm import LLM

    folder = prepare_model_folder(tiny_config, tmp_path / "m", 32)
    config = load_pretrained_config(folder)
    llm = LLM(model=str(folder), load_format="dummy", dtype="float32", device="cpu",
              max_batch_size=4, max_seq_len=512)  # fmt: skip
    try:
        spy = _Recorder(llm)
        workload = Workload(ISL, OSL, 1, 32, 2)
        words = single_token_words(folder / "tokenizer.json")
        run, turns = run_multi_turn_llm(spy, config, workload, words, MultiTurnSpec(3, 10), 2)
        assert [t["requests"] for t in turns] == [2, 2, 2]
        # Per conversation, by its image: turn k's messages hold turn k-1's answer text.
        conv = llm_conversations(llm, config, workload, words, MultiTurnSpec(3, 10), 2)[0]
        image = conv.image_parts[0]["image"]
        mine = [(p, h) for p, h in spy.calls if p["prompt"][0]["content"][0]["image"] == image]
        assert len(mine) == 3
        for k, (prompt, _) in enumerate(mine):
            messages = prompt["prompt"]
            assert messages[0]["content"][0]["image"] == image  # the image in every turn
            assert [m["content"] for m in messages[1::2]] == [h.text for _, h in mine[:k]]
            assert all(h.text for _, h in mine)  # random ids decode to text: answers are real
        # --max_tokens_dist: every request asks for 48 tokens, stops at its draw, in [3, 8].
        before = llm.get_stats().num_cancelled
        early = Workload(ISL, 48, 1, 32, 6)
        stops = draw_stops(3, 8, 6)
        prompts = make_requests(config, early)
        row = run_early_stop_llm(llm, prompts, sampling_params(early), stops, 3)
        assert row["requests"] == 6 and row["output_tokens"] == sum(stops)
        assert row["stop_tokens_mean"] == sum(stops) / 6 and 1 <= row["peak_running"] <= 3
        stats = llm.get_stats()
        assert stats.num_cancelled - before == 6 and stats.num_running == 0
        # The cancel landed within a few steps, long before the 48 tokens asked for.
        assert row["overshoot_tokens_mean"] < 48 - 8
    finally:
        llm.shutdown()


def _image_url(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"][0]["image_url"]["url"])


# ---- served --------------------------------------------------------------------------------------
def test_served_multi_turn_and_early_stop(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorrt_llm.bench import multi_turn_run

    sent: list[tuple[dict[str, Any], Any]] = []

    async def recording_post(*args: Any, **kwargs: Any) -> Any:
        res = await post_stream(*args, **kwargs)
        sent.append((json.loads(args[3]), res))
        return res

    monkeypatch.setattr(multi_turn_run, "post_stream", recording_post)
    argv = ["--config", str(tiny_config), *_TINY]
    folder = prepare_model_folder(tiny_config, tmp_path / "model", 32)
    flags = serve_flags(parse_args([*argv, *_MULTI, "--osl", "48"]), folder)
    server = ServerProcess(flags, tmp_path / "serve.log")
    try:
        server.wait_ready(120)
        url = f"http://{server.host}:{server.port}"
        out = tmp_path / "multi.json"
        assert main([*argv, *_MULTI, "--served_url", url, "--output", str(out)]) == 0
        result = json.loads(out.read_text())
        assert "ours" not in result
        run = result["served"][0]
        assert run["requests"] == 2 * TURNS and run["output_tokens"] == 2 * TURNS * OSL
        _check_turn_rows(result["served_turns"])
        # Per conversation (by its image's data URL): turn k resends turn k-1's streamed answer.
        by_image: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        for body, res in sent:
            by_image.setdefault(_image_url(body), []).append((body, res))
        timed = [turns for turns in by_image.values() if len(turns) > 1]
        assert len(timed) == 2 and all(len(t) == TURNS for t in timed)  # + 2 warm-up turns
        for turns in timed:
            for k, (body, _) in enumerate(turns):
                answers = [m["content"] for m in body["messages"][1::2]]
                assert answers == [res.text for _, res in turns[:k]] and all(answers)

        def cancelled() -> float:
            body = get_body(server.host, server.port, "/metrics")
            assert body is not None
            samples = parse_prometheus(body.decode())
            return sum(v for k, v in samples.items() if "requests_cancelled_total" in k)

        before = cancelled()
        out = tmp_path / "early.json"
        early = ["--osl", "48", "--max_tokens_dist", "3", "8", "--num_requests", "4"]
        assert main([*argv, *early, "--served_url", url, "--output", str(out)]) == 0
        row = json.loads(out.read_text())["served"][0]
        stops = draw_stops(3, 8, 4, seed=2)  # a wave's seed is its concurrency (2 here)
        assert row["requests"] == 4 and row["output_tokens"] == sum(stops)
        # The server aborted each request when its client closed the stream.
        deadline = time.monotonic() + 10
        while cancelled() - before < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cancelled() - before == 4
    finally:
        server.stop()
