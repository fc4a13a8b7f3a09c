"""Vocoders: HiFT (CosyVoice 1/2 HiFTGenerator, CosyVoice 3 CausalHiFTGenerator)."""
