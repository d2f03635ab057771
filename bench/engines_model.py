"""The engines bench's model and its prompt text.

**The model** is a Llama-shaped Hugging Face directory (``config.json`` and a copy of the shipped
reference tokenizer, no weights file: vLLM runs it with ``--load-format dummy``). Answers are
gibberish; prompts, prefix caching, KV events and the cost of prefill are real. The default
shape (384 wide, 6 layers, ~12M parameters) is sized so that on the 2-core development machine
a cold prefill of 2,048 tokens takes more than 10x a fully cached one (0.72 s against 30 ms
measured on one core while writing this); the bench measures the ratio on every run
(``bench_engines.measure_prefill``) rather than trusting this number.

**The text.** A trace block becomes a run of words, each of which the reference tokenizer
encodes as exactly one token (a leading space, then a whole vocabulary entry: the byte-level
pre-tokenizer splits before every space, so no merge crosses two words). A prompt's ids are
therefore the chat template's ids around the concatenation of its blocks' ids, and two prompts
that share their first k trace blocks share their first ``header + k * block_tokens`` ids, as
their trace prefixes are shared. ``check_words`` proves it for the tokenizer in use.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.text.tokenizer import REFERENCE_TOKENIZER, TextTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CPUINFO = Path("/proc/cpuinfo")


def engine_dtype(cpuinfo: str | None = None) -> tuple[str, int]:
    """The dtype the engines compute in (vLLM's ``--dtype``) and its bytes per value.

    bfloat16, what ``--dtype auto`` picks on x86, where the CPU has AVX-512: vLLM's CPU build
    runs it through its AVX-512 kernels. float32 where the CPU has only AVX2: there vLLM runs
    bfloat16 through its AVX2 kernels, emulated, at a fraction of float32's speed (measured on
    a 2-core AVX2 machine: a cold prefill of 2,048 tokens took 5,962 ms in bfloat16 and 1,317
    ms in float32), so every case would last four times as long for nothing the bench measures.
    ``cpuinfo``: the text of /proc/cpuinfo (read when None; no such file: bfloat16)."""
    if cpuinfo is None:
        cpuinfo = CPUINFO.read_text() if CPUINFO.exists() else ""
    flags = next((line.partition(":")[2].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), None)
    if flags is not None and "avx512f" not in flags:
        return "float32", 4
    return "bfloat16", 2

WORDS = (
    "th", "the", "re", "an", "and", "on", "in", "worker", "st", "is", "with", "no", "wh", "ca",
    "of", "it", "rep", "co", "its", "ro", "ne", "coordinator", "for", "to", "or", "one",
    "token", "de", "key", "ch", "as", "that", "un", "every", "fi", "replica", "from", "lo",
    "are", "ser", "not", "The", "by", "ev", "be", "version", "so", "en", "at", "call", "rout",
)
"""Vocabulary entries of the reference tokenizer that ``" " + word`` encodes as one id."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama decoder's sizes. ``head_dim`` 64: vLLM's CPU attention supports 32, 64, 80, ...
    ``max_positions``: the model's context (vLLM's ``--max-model-len``)."""

    hidden: int = 384
    layers: int = 6
    heads: int = 6
    intermediate: int = 1152
    head_dim: int = 64
    max_positions: int = 4096

    def parameters(self, vocab_size: int) -> int:
        """Weights, embeddings and the untied output layer included (norms left out)."""
        attention = 4 * self.hidden * self.heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + 2 * vocab_size * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token (keys and values of every layer), bfloat16 by default
        (``engine_dtype`` says what the engines compute in)."""
        return 2 * self.layers * self.heads * self.head_dim * dtype_bytes


def llama_config(shape: ModelShape, tokenizer: TextTokenizer) -> dict[str, Any]:
    """``config.json`` for ``shape`` over ``tokenizer``'s vocabulary (every id it emits has an
    embedding row). float32, as a checkpoint of fresh random weights would say; no BOS."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "head_dim": shape.head_dim,
        "vocab_size": tokenizer.vocab_size,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
    }


def write_model(directory: Path, shape: ModelShape,
                tokenizer_dir: Path = REFERENCE_TOKENIZER) -> TextTokenizer:
    """Write the model directory (created if missing, files overwritten); returns its
    tokenizer, loaded from the copy as the engines and the gateway load it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, directory / name)
    tokenizer = TextTokenizer.load(directory)
    config = llama_config(shape, tokenizer)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def block_words(hash_id: int, tokens: int) -> list[str]:
    """The ``tokens`` words trace block ``hash_id`` becomes: the same id, the same words."""
    digest = hashlib.shake_128(b"kvcoord.bench.engines:%d" % hash_id).digest(tokens)
    return [WORDS[byte % len(WORDS)] for byte in digest]


def prompt_text(hash_ids: tuple[int, ...], block_tokens: int, tokens: int) -> str:
    """The first ``tokens`` words of the blocks ``hash_ids``, each with its leading space."""
    words: list[str] = []
    for hash_id in hash_ids:
        if len(words) >= tokens:
            break
        words += block_words(hash_id, block_tokens)
    return "".join(" " + word for word in words[:tokens])


def chat(text: str) -> list[dict[str, str]]:
    """The request's messages: one user turn holding the text."""
    return [{"role": "user", "content": text}]


def template_tokens(tokenizer: TextTokenizer) -> int:
    """Ids the chat template adds around a user message's words."""
    return len(tokenizer.encode_chat(chat("")))


def check_words(tokenizer: TextTokenizer) -> None:
    """ValueError unless every word is one id and a prompt's ids are the template's around
    its words' ids, with a longer prompt extending a shorter one (the shared-prefix property
    the bench relies on)."""
    bad = [w for w in WORDS if len(tokenizer.encode(" " + w, add_special_tokens=False)) != 1]
    if bad:
        raise ValueError(f"{tokenizer.source}: words that are not one token: {bad}")
    short = prompt_text((1, 2), 64, 100)
    long = prompt_text((1, 2, 3), 64, 150)
    ids_short = tokenizer.encode_chat(chat(short))
    ids_long = tokenizer.encode_chat(chat(long))
    header = _common_prefix(tokenizer.encode_chat(chat(" the")),
                            tokenizer.encode_chat(chat(" of")))
    overhead = template_tokens(tokenizer)
    if len(ids_short) != 100 + overhead or len(ids_long) != 150 + overhead:
        raise ValueError(f"{tokenizer.source}: prompts do not encode one id per word")
    shared = header + 100
    if ids_short[:shared] != ids_long[:shared]:
        raise ValueError(f"{tokenizer.source}: a shared prefix of words is not shared ids")


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
