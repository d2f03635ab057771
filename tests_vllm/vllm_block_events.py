"""Run under vLLM's interpreter: real block events from vLLM's own code, on vLLM's own publisher.

Nothing here is written by hand the way ``tests/engine_publisher.py`` writes bytes: each
request is a real ``vllm.v1.request.Request`` (LoRA, cache salt, image features as vLLM builds
them), its blocks are cached by a real ``BlockPool`` with KV-cache events on, the group kind is
what ``get_kv_cache_spec_kind`` says of a real ``FullAttentionSpec`` or ``SlidingWindowSpec``
(as ``KVCacheManager.take_events`` annotates it), and every batch goes out through a real
``ZmqEventPublisher``. Evictions are the pool's own: blocks freed, then new blocks taken.

Protocol with the test, one JSON line each way:
- argv[1]: the publisher's endpoint (``ipc://...``), argv[2]: the block size;
- prints ``{"bound": true}`` once the publisher is up;
- reads one step a line and prints ``{"done": n}`` after publishing its events (n events):
  ``{"cache": {...request...}, "group": g, "kind": "full_attention"|"sliding_window"}``,
  ``{"free": request_id, "group": g}`` (its blocks to the free queue, still cached),
  ``{"evict": true}`` (every free block taken, which evicts every freed cached block, then
  given back uncached),
  ``{"exit": true}``.
A request is ``{"id", "tokens", "lora": name|null, "salt": str|null,
"images": [[identifier, offset, length], ...]}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request

POOL_BLOCKS = 64


def spec(kind: str, block_size: int) -> Any:
    shape = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8,
             "dtype": torch.float32}
    if kind == "sliding_window":
        return SlidingWindowSpec(**shape, sliding_window=2 * block_size)
    return FullAttentionSpec(**shape)


def request(raw: dict[str, Any], block_size: int, loras: dict[str, int]) -> Request:
    lora = raw.get("lora")
    lora_request = None
    if lora is not None:
        loras.setdefault(lora, len(loras) + 1)
        lora_request = LoRARequest(lora, loras[lora], f"/adapters/{lora}")
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=offset, length=length))
                for ident, offset, length in raw.get("images", [])]
    return Request(raw["id"], raw["tokens"], SamplingParams(max_tokens=1), None,
                   mm_features=features or None, lora_request=lora_request,
                   cache_salt=raw.get("salt"),
                   block_hasher=get_request_block_hasher(block_size, sha256))


def main() -> None:
    endpoint, block_size = sys.argv[1], int(sys.argv[2])
    init_none_hash(sha256)
    pool = BlockPool(POOL_BLOCKS, enable_caching=True, hash_block_size=block_size,
                     enable_kv_cache_events=True)
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    held: dict[tuple[str, int], list[Any]] = {}
    loras: dict[str, int] = {}
    print(json.dumps({"bound": True}), flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        if step.get("exit"):
            break
        if "cache" in step:
            req = request(step["cache"], block_size, loras)
            group = step["group"]
            blocks = pool.get_new_blocks(len(req.block_hashes))
            pool.cache_full_blocks(req, blocks, 0, len(blocks), block_size, group)
            held[(req.request_id, group)] = blocks
        elif "free" in step:
            pool.free_blocks(held.pop((step["free"], step["group"])))
        elif step.get("evict"):
            pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
        events = pool.take_events()
        for event in events:  # as KVCacheManager.take_events annotates them
            if getattr(event, "group_idx", None) is not None and hasattr(
                    event, "kv_cache_spec_kind"):
                group_spec = spec(step.get("kind", "full_attention"), block_size)
                event.kv_cache_spec_kind = get_kv_cache_spec_kind(group_spec).value
                event.kv_cache_spec_sliding_window = get_kv_cache_spec_sliding_window(
                    group_spec)
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        print(json.dumps({"done": len(events)}), flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
