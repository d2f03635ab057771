"""``TextTokenizer``: a Hugging Face tokenizer directory, loaded as an engine loads it.

A directory holds ``tokenizer.json`` (the fast tokenizer: vocabulary, merges, pre- and
post-processing) and ``tokenizer_config.json`` (special tokens, ``model_max_length`` and the
chat template; a ``chat_template.jinja`` file beside it wins over the config's, as in
``transformers``). Token ids come out as ``transformers`` gives them: a completion prompt with
the special tokens the post-processor adds (``add_special_tokens=True``), a chat as its rendered
template without them (the template writes its own), so a router hashing these ids hashes what
the engine will compute.

Chat content may be a string or a list of text parts; parts are joined with newlines, which is
what vLLM does for templates that take string content. Other parts (images, audio) are refused.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.text.chat_template import ChatTemplate, ChatTemplateError
from worker.text.segment_cache import SegmentEncoder, SplitToken

REFERENCE_TOKENIZER = Path(__file__).resolve().parent / "reference_tokenizer"
"""The tokenizer and chat template shipped for the reference model's 512-id vocabulary."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# transformers writes a huge number into model_max_length when a model sets none.
_NO_LIMIT = 10**9

__all__ = ["REFERENCE_TOKENIZER", "ChatTemplateError", "TextTokenizer", "TokenizerError",
           "reference_tokenizer"]


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, or input it cannot encode; the message names
    the file or the field."""


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the one called "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: chat_template must be a "
                             "string or a list of named templates")
    return source


def _text_content(content: object, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise TokenizerError(f"messages[{index}].content: only text parts are "
                                     f"supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise TokenizerError(f"messages[{index}].content must be a string or a list of text parts")


class TextTokenizer:
    """Encode and decode as the model's engine does (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, chat_template: ChatTemplate | None,
                 special_tokens: Mapping[str, str], max_context: int | None,
                 source: str) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.max_context = max_context
        self.source = source
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = None if eos is None else tokenizer.token_to_id(eos)
        # A chat is encoded a message at a time, each message's ids cached (segment_cache).
        self.segments = SegmentEncoder(
            lambda text: self.encode(text, add_special_tokens=False),
            [SplitToken(str(t.content), bool(t.lstrip), bool(t.normalized))
             for t in tokenizer.get_added_tokens_decoder().values()])

    @classmethod
    def load(cls, directory: str | Path, *, max_context: int | None = None) -> TextTokenizer:
        """Load ``directory``; ``max_context`` (tokens) overrides the config's
        ``model_max_length``. TokenizerError naming what is missing or malformed."""
        from tokenizers import Tokenizer

        path = Path(directory)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory {str(path)!r} does not exist")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: no such file (a Hugging Face fast "
                                 "tokenizer directory has tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file}: not a tokenizer ({exc})") from None
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{config_file}: not JSON ({exc})") from None
            if not isinstance(loaded, dict):
                raise TokenizerError(f"{config_file}: must hold a JSON object")
            config = loaded
        special = {name: text for name in SPECIAL_TOKEN_NAMES
                   if (text := _token_text(config.get(name))) is not None}
        source = _chat_template_source(path, config)
        try:
            template = None if source is None else ChatTemplate(source)
        except ChatTemplateError as exc:
            raise TokenizerError(f"{path}: {exc}") from None
        if max_context is None:
            limit = config.get("model_max_length")
            if isinstance(limit, int | float) and 0 < limit < _NO_LIMIT:
                max_context = int(limit)
        elif max_context < 1:
            raise TokenizerError(f"max_context must be >= 1 token, got {max_context}")
        return cls(tokenizer, chat_template=template, special_tokens=special,
                   max_context=max_context, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids, with the post-processor's special tokens by default."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any,
    ) -> str:
        """The conversation as text. TokenizerError when the tokenizer has no chat template or
        a message is malformed; ChatTemplateError when the template refuses it."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template")
        normalized = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TokenizerError(f"messages[{index}] must be an object")
            content = _text_content(message.get("content"), index)
            normalized.append({**message, "content": content})
        return self.chat_template.render(
            normalized, add_generation_prompt=add_generation_prompt, tools=tools,
            variables={**self.special_tokens, **variables},
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any,
    ) -> list[int]:
        """The conversation's ids: its rendered template, encoded without special tokens (a
        message at a time, its ids cached: ``segment_cache``)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, **variables)
        return self.segments.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


@functools.cache
def reference_tokenizer() -> TextTokenizer:
    """The shipped tokenizer of the reference model (loaded once per process)."""
    return TextTokenizer.load(REFERENCE_TOKENIZER)
