"""Vocoders: HiFT (CosyVoice 1/2 HiFTGenerator, CosyVoice 3 CausalHiFTGenerator)."""

from mizuoto.nn.vocoders.hift import CausalHiFTGenerator, HiFTGenerator, randn_like

__all__ = ["HiFTGenerator", "CausalHiFTGenerator", "randn_like"]
