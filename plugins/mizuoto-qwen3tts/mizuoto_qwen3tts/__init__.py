"""Qwen3-TTS (12 Hz: Base clone, CustomVoice presets, VoiceDesign) for Mizuoto, in progress.

What exists: the text prompts as upstream (`qwen-tts` 0.1.1) lays them out and their token ids
(`prompt`). The engine itself is not written yet and no engine is registered (README.md).
"""
