"""Chatterbox and Chatterbox-Turbo (Resemble AI, MIT) for Mizuoto, built from `mizuoto.nn` blocks.

In progress: T3 (text to speech tokens) is here and matches upstream chatterbox-tts 0.1.7 token for
token on the recorded cases (tests/); S3Gen, the voice encoder and the engine itself are not yet, so
the package registers no engine entry point.
"""
