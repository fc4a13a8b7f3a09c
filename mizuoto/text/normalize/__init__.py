"""Text normalization: wetext 0.0.4 on kaldifst and upstream CosyVoice's text front end around it."""

from mizuoto.text.normalize.pipeline import TextFrontend
from mizuoto.text.normalize.wetext import WetextNormalizer, contains_chinese

__all__ = ["TextFrontend", "WetextNormalizer", "contains_chinese"]
