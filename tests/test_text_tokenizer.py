"""The tokenizer the gateway and the reference worker share gives the ids ``transformers`` gives:
the same chat template rendering (``apply_chat_template``) and the same encoding, on the shipped
tokenizer and on Llama-3-like and ChatML-like templates; bad directories and refused
conversations get errors that say why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from worker.runtime.engine import ModelConfig
from worker.text.tokenizer import (
    REFERENCE_TOKENIZER,
    ChatTemplateError,
    TextTokenizer,
    TokenizerError,
    reference_tokenizer,
)

LLAMA3_LIKE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unexpected role ' + message['role']) }}
    {%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
    + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_LIKE = """{%- set ns = namespace(has_system=false) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% set ns.has_system = true %}{% endif %}
{%- endfor %}
{%- if not ns.has_system %}
<|im_start|>system
You are a helpful assistant.{% if tools %} Tools: {{ tools | tojson }}{% endif %}<|im_end|>
{% endif %}
{% for message in messages %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}
    {% else %}
{{ message.content }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Why KV?"},
     {"role": "assistant", "content": "Reuse."}, {"role": "user", "content": "ünïcødé ✓ 漢字"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  spaced  "},
     {"role": "user", "content": "line one\nline two\n\n"}],
    [{"role": "user", "content": "a literal <|im_end|> and <|eot_id|> inside", "name": None}],
]


def write_template_dir(path: Path, template: str, *, specials: list[str], bos: str | None,
                       eos: str) -> Path:
    """The shipped vocabulary with ``specials`` added (and a post-processor that prepends
    ``bos``), under another chat template."""
    path.mkdir()
    tokenizer = Tokenizer.from_file(str(REFERENCE_TOKENIZER / "tokenizer.json"))
    tokenizer.add_special_tokens(specials)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                              "model_max_length": 8192, "chat_template": template}
    if bos is not None:
        config["bos_token"] = {"__type": "AddedToken", "content": bos, "lstrip": False,
                               "normalized": False, "rstrip": False, "single_word": False,
                               "special": True}  # the form transformers saves
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "shipped": REFERENCE_TOKENIZER,
        "llama3_like": write_template_dir(
            root / "llama3", LLAMA3_LIKE, bos="<|begin_of_text|>", eos="<|eot_id|>",
            specials=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>"]),
        "chatml_like": write_template_dir(root / "chatml", CHATML_LIKE, bos=None,
                                          eos="<|im_end|>", specials=[]),
    }


def hf_chat_ids(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("style", ["shipped", "llama3_like", "chatml_like"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_ids_equal_transformers_apply_chat_template(
    tokenizer_dirs: dict[str, Path], style: str, generation_prompt: bool
) -> None:
    ours = TextTokenizer.load(tokenizer_dirs[style])
    hf = AutoTokenizer.from_pretrained(tokenizer_dirs[style])
    for messages in CONVERSATIONS:
        expected_text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render_chat(messages, add_generation_prompt=generation_prompt) \
            == expected_text
        assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) \
            == hf_chat_ids(hf, messages, add_generation_prompt=generation_prompt)


def test_tools_reach_the_template_as_transformers_passes_them(
    tokenizer_dirs: dict[str, Path]
) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Ünïcode",
                                                "parameters": {"type": "object"}}}]
    ours = TextTokenizer.load(tokenizer_dirs["chatml_like"])
    hf = AutoTokenizer.from_pretrained(tokenizer_dirs["chatml_like"])
    messages = CONVERSATIONS[0]
    assert "Ünïcode" in ours.render_chat(messages, tools=tools)  # tojson keeps non-ASCII
    assert ours.encode_chat(messages, tools=tools) == hf_chat_ids(  # ours adds it by default
        hf, messages, tools=tools, add_generation_prompt=True)


@pytest.mark.parametrize("style", ["shipped", "llama3_like"])
def test_completion_prompts_encode_with_the_post_processors_special_tokens(
    tokenizer_dirs: dict[str, Path], style: str
) -> None:
    ours = TextTokenizer.load(tokenizer_dirs[style])
    hf = AutoTokenizer.from_pretrained(tokenizer_dirs[style])
    for text in ["Once upon a time", "", "ünïcødé ✓\n\tend", "<|im_start|>literal"]:
        assert ours.encode(text) == hf(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) \
            == hf(text, add_special_tokens=False)["input_ids"]
    if style == "llama3_like":
        assert ours.encode("x")[0] == hf.bos_token_id  # the BOS the engine prepends


def test_the_shipped_tokenizer_fits_the_reference_model() -> None:
    model = ModelConfig()
    shipped = reference_tokenizer()
    assert shipped.vocab_size == model.vocab_size == 512
    assert shipped.max_context == model.max_context == 4096
    assert shipped.eos_token_id is not None and shipped.eos_token_id < model.vocab_size
    text = "The coordinator routes prompts to the worker holding their prefix. ünïcødé ✓"
    ids = shipped.encode(text)
    assert max(ids) < model.vocab_size and shipped.decode(ids) == text
    # Byte-level: any id sequence decodes, and the chat's own tokens are single ids.
    assert isinstance(shipped.decode(list(range(model.vocab_size))), str)
    assert shipped.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_text_parts_are_joined_with_newlines_and_other_parts_refused() -> None:
    shipped = reference_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}]}]
    assert shipped.encode_chat(parts) == shipped.encode_chat(
        [{"role": "user", "content": "one\ntwo"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(TokenizerError, match=r"messages\[0\]\.content: only text parts.*image_url"):
        shipped.encode_chat(image)
    with pytest.raises(TokenizerError, match=r"messages\[1\] must be an object"):
        shipped.encode_chat([{"role": "user", "content": "a"}, "b"])  # type: ignore[list-item]


def test_a_refusing_template_says_why_as_transformers_does(tokenizer_dirs: dict[str, Path]) -> None:
    bad = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    ours = TextTokenizer.load(tokenizer_dirs["llama3_like"])
    hf = AutoTokenizer.from_pretrained(tokenizer_dirs["llama3_like"])
    with pytest.raises(jinja2.exceptions.TemplateError, match="unexpected role robot"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"^unexpected role robot$"):
        ours.encode_chat(bad)
    with pytest.raises(ChatTemplateError, match="roles are system, user and assistant"):
        reference_tokenizer().encode_chat(bad)


def test_a_chat_template_jinja_file_wins_over_the_configs(tmp_path: Path) -> None:
    directory = tmp_path / "tok"
    shutil.copytree(REFERENCE_TOKENIZER, directory)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    ours = TextTokenizer.load(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    messages = CONVERSATIONS[1]
    assert ours.render_chat(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages).startswith("[system]")


def test_unusable_directories_are_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        TextTokenizer.load(tmp_path / "missing")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: no such file"):
        TextTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a tokenizer"):
        TextTokenizer.load(tmp_path)
    shutil.copy(REFERENCE_TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: must hold a JSON object"):
        TextTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        TextTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10**30}))
    loaded = TextTokenizer.load(tmp_path)
    assert loaded.max_context is None  # transformers' "no limit" number is not a limit
    assert TextTokenizer.load(tmp_path, max_context=2048).max_context == 2048
    with pytest.raises(TokenizerError, match="max_context must be >= 1"):
        TextTokenizer.load(tmp_path, max_context=0)
    with pytest.raises(TokenizerError, match="has no chat template"):
        loaded.encode_chat([{"role": "user", "content": "hi"}])


def test_namespaces_refuse_underscore_names() -> None:
    from worker.text.chat_template import ChatTemplate
    template = ChatTemplate("{% set ns = namespace(_secret=1) %}{{ ns }}")
    with pytest.raises(ChatTemplateError, match="underscore name"):
        template.render([])


def test_a_stream_decoded_token_by_token_is_the_whole_text_and_never_half_a_character() -> None:
    from worker.http_api.openai_responses import IncrementalText

    shipped = reference_tokenizer()
    for text in ["ünïcødé ✓ 漢字, then plain words and\nnew lines", "✓✓✓ 漢字漢字", "a"]:
        ids = shipped.encode(text, add_special_tokens=False)
        stream = IncrementalText(shipped.decode)
        deltas = [stream.add(token) for token in ids] + [stream.rest()]
        assert "".join(deltas) == shipped.decode(ids) == text
        assert all("\ufffd" not in delta for delta in deltas)
        assert len(ids) > len(text.encode()) // 4  # byte tokens: characters do get split
