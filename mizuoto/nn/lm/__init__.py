"""Decoder LMs with transformers-exact numerics and static/dynamic KV caches."""

from mizuoto.nn.lm.kv_cache import DynamicKVCache, KVCache, StaticKVCache
from mizuoto.nn.lm.decoder import DecoderConfig, Decoder

__all__ = ["DynamicKVCache", "KVCache", "StaticKVCache", "DecoderConfig", "Decoder"]
