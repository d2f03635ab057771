"""What an OpenAI request asks to be routed: its body checked as the engines check it
(``worker.http_api.openai_requests``), its prompts tokenized exactly as the engine does
(``worker.text``: the chat template as Hugging Face renders it), its model and context checked,
and the hash namespace it names. ``kvcoord gateway`` and ``kvcoord epp`` both read requests
here, so that both route the same ids in the same namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcoord.gateway.config import GatewayConfig
from kvcoord.gateway.routing import RequestScope
from worker.http_api.openai_requests import (
    CompletionRequest,
    OpenAIError,
    parse_chat,
    parse_completion,
)
from worker.http_api.serving import check_context, check_model, json_body
from worker.text.tokenizer import TextTokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A request ready to route: its prompts' token ids (one for a chat), the namespace they
    hash in, and, for a completion, the parsed request (several prompts fan out by it)."""

    prompts: list[list[int]]
    scope: RequestScope
    completion: CompletionRequest | None = None


class RequestReader:
    """Reads requests for the model ``config`` names (and its adapters) with ``tokenizer``."""

    def __init__(self, config: GatewayConfig, tokenizer: TextTokenizer) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self.max_context = config.max_context or tokenizer.max_context

    def read(self, path: str, raw: bytes) -> ReadRequest:
        """The request ``raw`` posted to ``path`` (its query string ignored); OpenAIError 404
        for a path that is neither chat nor completions, else as ``chat``/``completion``."""
        endpoint = path.partition("?")[0]
        if endpoint == CHAT_PATH:
            return self.chat(json_body(raw))
        if endpoint == COMPLETIONS_PATH:
            return self.completion(json_body(raw))
        raise OpenAIError(404, f"no such endpoint: {endpoint}", code="not_found")

    def chat(self, body: Any) -> ReadRequest:
        """A chat request's prompt (its messages and tools through the chat template);
        OpenAIError 400 for a malformed body or a prompt that does not fit, 404 for a model
        not served."""
        parsed = parse_chat(body)
        prompt = self._tokenizer.encode_chat(parsed.messages, tools=parsed.tools)
        self._check(parsed.model, prompt, parsed.sampling.max_tokens)
        return ReadRequest([prompt], self._scope(parsed.model, body))

    def completion(self, body: Any) -> ReadRequest:
        """A completion request's prompts (text tokenized, ids as given); as ``chat``."""
        parsed = parse_completion(body)
        prompts = [p if isinstance(p, list) else self._tokenizer.encode(p)
                   for p in parsed.prompts]
        for prompt in prompts:
            self._check(parsed.model, prompt, parsed.sampling.max_tokens)
        return ReadRequest(prompts, self._scope(parsed.model, body), parsed)

    def _check(self, model: str, prompt: list[int], max_tokens: int) -> None:
        """OpenAIError 404 for a model not served (neither the model nor one of its
        adapters), 400 for a prompt that does not fit."""
        if model not in self._config.adapters:
            check_model(model, self._config.model, "this gateway")
        check_context(prompt, max_tokens, self.max_context)

    def _scope(self, model: str, body: Any) -> RequestScope:
        """The hash namespace the request names: its adapter (``model``, when that is one of
        ours) and its ``cache_salt`` (OpenAIError 400 unless a non-empty string, as vLLM)."""
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise OpenAIError(400, "cache_salt must be a non-empty string if given",
                              param="cache_salt")
        return RequestScope(model if model in self._config.adapters else None, salt)
