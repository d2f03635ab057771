"""Chat templates rendered as Hugging Face renders them, so a conversation becomes the same text
(and, through the same tokenizer, the same token ids) here as in an engine that loads the model
with ``transformers``.

What Hugging Face does, and this module does too: Jinja in an immutable sandbox with
``trim_blocks`` and ``lstrip_blocks`` and the loop-control extension; a ``tojson`` filter that
does not escape HTML and keeps non-ASCII (``json.dumps(..., ensure_ascii=False)``);
``raise_exception(message)`` and ``strftime_now(format)`` as globals; ``namespace`` objects that
refuse underscore names; the ``{% generation %}`` block rendering its body as it is. The
variables are the conversation (``messages``, ``tools``, ``documents``), ``add_generation_prompt``,
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and any extra keyword.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refused the conversation (its ``raise_exception``)
    or failed while rendering it; the message says which and why."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` as templates use it, refusing underscore names (no way to CPython
    internals through a stored attribute)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own trick: "self" may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store {name!r} on a namespace (underscore name)")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks the assistant's part for training
    masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True)
        return body


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = dict
    return env


class ChatTemplate:
    """One compiled chat template. ChatTemplateError when ``source`` does not compile."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the model sees it. ``messages`` keys whose value is None are
        left out (as Hugging Face does); ``variables`` (special tokens, extra template
        arguments) come before the conversation's own names, which win. ChatTemplateError when
        the template refuses or fails."""
        conversation = [{k: v for k, v in message.items() if v is not None}
                        for message in messages]
        try:
            return self._template.render(**{
                **(variables or {}), "messages": conversation, "tools": tools,
                "documents": documents, "add_generation_prompt": add_generation_prompt,
            })
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") \
                from None
