"""Builds ``reference_tokenizer/``, the tokenizer the project ships for the reference model
(``worker.runtime.engine.ModelConfig``: 512 token ids, 4,096 tokens of context).

``python -m worker.text.build_reference_tokenizer [DIR]`` trains a byte-level BPE of exactly
512 ids (3 special tokens, the 256 byte symbols, 253 merges) on the project's own Markdown
documents, and writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)
to DIR (default: the shipped folder). The committed files are what runs; this records how they
were made. Byte-level, so every string encodes, and every id sequence decodes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "reference_tokenizer"
VOCAB_SIZE = 512
MAX_CONTEXT = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML turns; with no system message, none is added. Whitespace control as Hugging Face
# renders templates (trim_blocks, lstrip_blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(root: Path) -> Iterator[str]:
    """The project's README and docs, paragraph by paragraph."""
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        yield from path.read_text().split("\n\n")


def build(out: Path, root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(root), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained {tokenizer.get_vocab_size()} ids, not {VOCAB_SIZE}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_CONTEXT,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED,
          Path(__file__).resolve().parents[2])
