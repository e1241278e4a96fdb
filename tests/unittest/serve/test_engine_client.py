"""The server uses the LLM only through the engine-client interface (engine_client.py)."""

from __future__ import annotations

from typing import Any

import httpx
from serve_helpers import ServeHandle, data_url, image_part, png_bytes, start_server, user

from tensorrt_llm.llmapi.engine_client import EngineClient

# The interface's members, plus the two plain attributes TensorRT-LLM's LLM also exposes.
ALLOWED = {
    "max_seq_len",
    "engine_alive",
    "is_shutdown",
    "prepare",
    "finalize",
    "submit",
    "preparer_spec",
    "get_stats",
    "shutdown",
    "args",
    "tokenizer",
}


class _PublicOnly:
    """The LLM seen through its public interface: anything else raises."""

    def __init__(self, llm: Any) -> None:
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "touched", set())

    def __getattr__(self, name: str) -> Any:
        if name not in ALLOWED:
            raise AttributeError(f"the server reached LLM.{name}, outside the interface")
        self.touched.add(name)
        return getattr(self._llm, name)


def test_server_needs_nothing_but_the_interface(served: ServeHandle) -> None:
    public = _PublicOnly(served.llm)
    assert isinstance(public, EngineClient)
    handle = start_server(["--demo"], llm=public)
    try:
        image = data_url(png_bytes(size=(48, 40)))
        for stream in (False, True):
            body = {
                "model": handle.model,
                "messages": user(image_part(image), "Describe it."),
                "stream": stream,
            }  # no max_tokens: the default, fitted to the context by finalize
            r = httpx.post(handle.base_url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        metrics = httpx.get(handle.base_url + "/metrics", timeout=10).text
        assert "trtllm_seq_slots_total" in metrics
    finally:
        handle.stop()
    assert {"prepare", "submit", "get_stats"} <= public.touched
