"""Chatterbox and Chatterbox-Turbo (Resemble AI, MIT) for Mizuoto, built from `mizuoto.nn` blocks.

In progress: T3 (text to speech tokens) and S3Gen (speech tokens to 24 kHz audio) are here and match
upstream chatterbox-tts 0.1.7 on the recorded cases (tests/); the voice encoder, clip conditioning
and the engine itself are not yet, so the package registers no engine entry point.
"""
