"""Training CosyVoice as upstream's bin/train.py does (features, llm, flow, export stages)."""
