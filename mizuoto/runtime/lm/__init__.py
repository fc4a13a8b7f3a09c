"""Decoder LMs with transformers-exact numerics and static/dynamic KV caches."""

from mizuoto.runtime.lm.kv_cache import DynamicKVCache, KVCache, StaticKVCache
from mizuoto.runtime.lm.qwen import QwenConfig, QwenDecoder

__all__ = ["DynamicKVCache", "KVCache", "StaticKVCache", "QwenConfig", "QwenDecoder"]
