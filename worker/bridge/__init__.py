"""The KV-events bridge: vLLM and SGLang engines as coordinator workers (``kvcoord bridge``)."""
