"""chat_template_kwargs reach the chat template (LLM.chat, prompt dicts, the server field)
and are refused where no template would see them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.inputs.chat_tokenize import tokenize_chat
from tensorrt_llm.inputs.data import as_prompt_dict
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint
from tensorrt_llm.tools.tiny_tokenizer import CHAT_TEMPLATE

# The demo template plus Qwen3's switch: thinking off closes an empty think block up front.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- 'no thinking here\\n' -}}{%- endif -%}",
)
KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_num_tokens=128, max_seq_len=128, tokens_per_block=16
)
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("thinking"))
    assert THINKING_TEMPLATE != CHAT_TEMPLATE
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    return path


def test_kwargs_change_the_rendered_prompt(ckpt: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    plain = tokenize_chat(tok, MESSAGES)
    off = tokenize_chat(tok, MESSAGES, {"enable_thinking": False})
    assert tokenize_chat(tok, MESSAGES, {"enable_thinking": True}) == plain
    assert off[: len(plain)] == plain and len(off) > len(plain)
    assert tok.decode(off[len(plain) :]) == "no thinking here\n"


def test_llm_chat_passes_kwargs(ckpt: Path) -> None:
    params = SamplingParams(max_tokens=2, temperature=0)
    with LLM(str(ckpt), executor_mode="inproc", **KWARGS) as llm:
        plain = llm.chat(MESSAGES, params)
        off = llm.chat(MESSAGES, params, chat_template_kwargs={"enable_thinking": False})
        both = llm.chat([MESSAGES, MESSAGES], params, use_tqdm=False)
    assert len(off.prompt_token_ids) > len(plain.prompt_token_ids)
    assert [r.prompt_token_ids for r in both] == [plain.prompt_token_ids] * 2


def test_kwargs_without_chat_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="apply to a prompt given as chat messages"):
        as_prompt_dict({"prompt": "plain text", "chat_template_kwargs": {"x": 1}})
    with pytest.raises(ValueError, match="may not set"):
        as_prompt_dict({"prompt": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
    with pytest.raises(TypeError, match="must be a dict"):
        as_prompt_dict({"prompt": MESSAGES, "chat_template_kwargs": ["enable_thinking"]})
    assert as_prompt_dict({"prompt": MESSAGES, "chat_template_kwargs": {}})["prompt"] == MESSAGES


def test_kwargs_the_template_never_reads_are_refused(ckpt: Path) -> None:
    # A typo would otherwise leave thinking on, silently; tools on a template without tool
    # support would never reach the model.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    with pytest.raises(ValueError, match=r"\['enable_thinkng'\]: this model's chat template") as e:
        tokenize_chat(tok, MESSAGES, {"enable_thinkng": False})
    assert "it reads ['enable_thinking']" in str(e.value)
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ValueError, match="does not render tools, so the model would never see"):
        tokenize_chat(tok, MESSAGES, {"tools": tools})
    tool_template = THINKING_TEMPLATE + "{%- if tools %}{{ tools | length }} tools{% endif -%}"
    custom = copy.copy(tok)
    custom.chat_template = tool_template
    assert tok.decode(tokenize_chat(custom, MESSAGES, {"tools": tools})).endswith("1 tools")
