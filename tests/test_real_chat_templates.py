"""Real models' chat templates (``tests/data/chat_templates``: Llama-3.1 with JSON tools, Qwen
with tools and a default system message, Qwen3/MiniCPM-V with tools and thinking; sources and
licences in its SOURCES.md) render with ``worker.text.chat_template`` exactly as
``transformers.apply_chat_template`` renders them, for plain turns, system messages and none,
tools, tool calls and tool responses, with and without the generation prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.test_text_tokenizer import write_template_dir
from worker.text.tokenizer import TextTokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
STYLES = {  # file -> (bos, eos, special tokens the template writes)
    "llama3.1_json_tools.jinja": ("<|begin_of_text|>", "<|eot_id|>",
                                  ["<|begin_of_text|>", "<|start_header_id|>",
                                   "<|end_header_id|>", "<|eot_id|>"]),
    "qwen2_5_coder_tools.jinja": (None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "minicpmv45_qwen3_tools.jinja": (None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für eine Stadt",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]}
PLAIN: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],  # no system message: the defaults apply
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Why KV?"},
     {"role": "assistant", "content": "Reuse."}, {"role": "user", "content": "ünïcødé ✓ 漢字"}],
    [{"role": "user", "content": "line one\nline two\n\n"},
     {"role": "assistant", "content": "  spaced  "}, {"role": "user", "content": "again"}],
]
WITH_TOOLS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Weather in Tokyo?"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Tokyo?"}, CALL,
     {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 21})},
     {"role": "user", "content": "And tomorrow?"}],
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TextTokenizer, Any]]:
    root = tmp_path_factory.mktemp("real-templates")
    out = {}
    for name, (bos, eos, specials) in STYLES.items():
        directory = write_template_dir(root / name, (TEMPLATES / name).read_text(),
                                       specials=specials, bos=bos, eos=eos)
        out[name] = (TextTokenizer.load(directory), AutoTokenizer.from_pretrained(directory))
    return out


@pytest.mark.parametrize("name", sorted(STYLES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_real_templates_render_as_transformers_renders_them(
    loaded: dict[str, tuple[TextTokenizer, Any]], name: str, generation_prompt: bool,
) -> None:
    ours, hf = loaded[name]
    cases = [(m, None) for m in PLAIN] + [(m, TOOLS) for m in WITH_TOOLS]
    for messages, tools in cases:
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=generation_prompt)
        assert ours.render_chat(messages, tools=tools,
                                add_generation_prompt=generation_prompt) == expected, \
            (name, messages[-1], tools is not None)
        assert ours.encode_chat(messages, tools=tools,
                                add_generation_prompt=generation_prompt) == list(
            hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                   add_generation_prompt=generation_prompt))


def test_the_templates_defaults_are_what_the_model_sees(
    loaded: dict[str, tuple[TextTokenizer, Any]],
) -> None:
    """The cases above reach each template's own branches: Qwen's default system message,
    Llama's tools in the first user message and its date, the Qwen3 tool turn."""
    qwen, _ = loaded["qwen2_5_coder_tools.jinja"]
    assert "You are Qwen, a helpful assistant." in qwen.render_chat(PLAIN[0])
    llama, _ = loaded["llama3.1_json_tools.jinja"]
    rendered = llama.render_chat(WITH_TOOLS[0], tools=TOOLS)
    assert "Given the following functions" in rendered and "Today Date: " in rendered
    qwen3, _ = loaded["minicpmv45_qwen3_tools.jinja"]
    assert "<tool_response>" in qwen3.render_chat(WITH_TOOLS[1], tools=TOOLS)
