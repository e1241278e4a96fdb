"""Stop strings are found on the front end, while the responses are applied.

`LLM.generate` applies every result's responses as they arrive, so a later request that meets
its stop string is cancelled in the engine at once, not when an earlier request finishes. A
non-streaming result without stop strings decodes its text once, at the end.
"""

from __future__ import annotations

import threading

from tensorrt_llm._torch.pyexecutor.executor_types import LlmResponse
from tensorrt_llm.llmapi.llm import _wait_all
from tensorrt_llm.llmapi.result import GenerationResult
from tensorrt_llm.sampling_params import SamplingParams


class CountingTokenizer:
    """Token i is the letter chr(97 + i); counts decode calls."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return "".join(chr(97 + i) for i in ids)


def _result(
    rid: int, tok: CountingTokenizer, aborted: list[int], **params: object
) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[0],
        sampling_params=SamplingParams(max_tokens=50, **params),  # type: ignore[arg-type]
        tokenizer=tok,
        child_request_ids=[rid],
        abort_fn=aborted.append,
    )


def test_a_later_request_is_cancelled_at_its_stop_string_while_an_earlier_one_runs() -> None:
    tok = CountingTokenizer()
    aborted: list[int] = []
    first = _result(0, tok, aborted)
    second = _result(1, tok, aborted, stop="cd")
    cancelled_while_first_ran = threading.Event()

    def engine() -> None:
        for token in (1, 2, 3, 4):  # "b" "c" "d" "e": the stop "cd" completes on token 3
            second._on_response(LlmResponse(1, [token]))
        for _ in range(200):
            if aborted:
                cancelled_while_first_ran.set()
                break
            threading.Event().wait(0.01)
        second._on_response(LlmResponse(1, [], True, "cancelled"))
        first._on_response(LlmResponse(0, [5, 6], True, "length"))

    feeder = threading.Thread(target=engine)
    feeder.start()
    finished: list[int] = []
    _wait_all([first, second], finished.append)
    feeder.join()
    assert cancelled_while_first_ran.is_set()
    assert aborted == [1]
    assert sum(finished) == 2
    out = second.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("b", "stop", "cd")
    assert out.token_ids == [1, 2, 3]  # nothing after the token that completed the stop
    assert first.outputs[0].text == "fg" and first.outputs[0].finish_reason == "length"


def test_non_streaming_without_stop_strings_decodes_once() -> None:
    tok = CountingTokenizer()
    result = _result(0, tok, [])
    for token in range(5):
        result._on_response(LlmResponse(0, [token]))
        result._process()
    assert tok.calls == 0 and result.outputs[0].text == ""
    result._on_response(LlmResponse(0, [5], True, "length"))
    result.result()
    assert tok.calls == 1 and result.outputs[0].text == "abcdef"


def test_streaming_decodes_as_tokens_arrive() -> None:
    tok = CountingTokenizer()
    result = GenerationResult(0, None, [0], SamplingParams(max_tokens=5), tok, [0], streaming=True)
    result._on_response(LlmResponse(0, [0, 1]))
    result._process()
    assert result.outputs[0].text == "ab"
