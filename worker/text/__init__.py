"""Text in and out of the workers: a Hugging Face tokenizer directory loaded as the engines load
it (``tokenizer``), its chat template rendered as Hugging Face renders it (``chat_template``),
and the small tokenizer the project ships for the reference model's vocabulary
(``reference_tokenizer/``). No torch: the gateway uses these as well."""
