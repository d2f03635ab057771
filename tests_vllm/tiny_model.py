"""A tiny Llama-shaped Hugging Face model directory, which vLLM's CPU build loads in a blink.

The directory holds ``config.json`` (``LlamaForCausalLM``) and a copy of the shipped reference
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with its ChatML template). There is no
weights file: vLLM is started with ``--load-format dummy``, which fills the weights with small
random values, so answers are gibberish but prompts, prefix caching and KV events are real.
No ``generation_config.json`` either: without one vLLM uses its own sampling defaults.

Sizes, and why:

- ``head_dim`` 64: vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16), and
  blocks of a multiple of 32 tokens.
- ``vocab_size``: the tokenizer's own (512 ids, added tokens included), read from the files,
  so every id the tokenizer emits has an embedding row.
- ``max_position_embeddings``: the tokenizer's ``model_max_length`` (4096; 4096 too when it
  has none); vLLM is started with a smaller ``--max-model-len`` to keep its buffers small.
- ``torch_dtype`` float32, as a checkpoint of fresh random weights would say. vLLM's
  ``--dtype auto`` computes in what the CPU build supports (on x86 it logs "Downcasting
  torch.float32 to torch.bfloat16").

``write_checkpoint(DIR, seed)`` adds real weights (``model.safetensors``, float32, every tensor
of ``LlamaForCausalLM`` by its Hugging Face name, drawn from ``seed``), for engines that must
reload weights in place (vLLM refuses ``reload_weights`` for ``--load-format dummy``). Two seeds
are two policies. The output projection is scaled so logits spread several units wide (the
final norm's output has unit RMS; ``lm_head`` std 0.5 over 128 dims gives logits of std ~5.7):
the top two logits of a greedy step are rarely within rounding of each other, so a sample
regenerated alone equals the same sample generated in a batch, token for token.

Usage: ``python -m tests_vllm.tiny_model DIR [--seed N]`` (prints DIR), or
``write_tiny_model(DIR)`` / ``write_checkpoint(DIR, seed)``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.text.tokenizer import REFERENCE_TOKENIZER, TextTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HEAD_DIM = 64
HEADS = 2
DEFAULT_MAX_POSITIONS = 4096


def tiny_llama_config(vocab_size: int, eos_token_id: int | None,
                      max_positions: int = DEFAULT_MAX_POSITIONS) -> dict[str, Any]:
    """``config.json`` of a 2-layer, 128-wide Llama with ``vocab_size`` ids."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * HEAD_DIM,
        "intermediate_size": 2 * HEADS * HEAD_DIM,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
    }


def write_tiny_model(directory: Path, tokenizer: Path = REFERENCE_TOKENIZER) -> Path:
    """Write the model directory (created if missing, its files overwritten) with a copy of
    ``tokenizer``'s files; returns ``directory``. TokenizerError when ``tokenizer`` cannot be
    loaded."""
    loaded = TextTokenizer.load(tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, directory / name)
    config = tiny_llama_config(loaded.vocab_size, loaded.eos_token_id,
                               loaded.max_context or DEFAULT_MAX_POSITIONS)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


LM_HEAD_STD = 0.5


def checkpoint_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every weight of ``config``'s ``LlamaForCausalLM``, float32, drawn from ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    vocab, layers = config["vocab_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * std

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, 1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(vocab, hidden, LM_HEAD_STD)}
    width = hidden ** -0.5
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": normal(hidden, hidden, width),
            f"{prefix}.self_attn.k_proj.weight": normal(kv, hidden, width),
            f"{prefix}.self_attn.v_proj.weight": normal(kv, hidden, width),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, hidden, width),
            f"{prefix}.mlp.gate_proj.weight": normal(inter, hidden, width),
            f"{prefix}.mlp.up_proj.weight": normal(inter, hidden, width),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, inter, inter ** -0.5),
            f"{prefix}.input_layernorm.weight": torch.ones(hidden),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        }
    return tensors


def write_checkpoint(directory: Path, seed: int, tokenizer: Path = REFERENCE_TOKENIZER) -> Path:
    """``write_tiny_model`` plus ``model.safetensors`` drawn from ``seed``; returns
    ``directory``."""
    from safetensors.torch import save_file

    write_tiny_model(directory, tokenizer)
    config = json.loads((directory / "config.json").read_text())
    save_file(checkpoint_tensors(config, seed), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests_vllm.tiny_model",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory", type=Path, help="where to write the model")
    parser.add_argument("--seed", type=int, help="also write weights drawn from this seed")
    args = parser.parse_args(argv)
    if args.seed is None:
        print(write_tiny_model(args.directory))
    else:
        print(write_checkpoint(args.directory, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
