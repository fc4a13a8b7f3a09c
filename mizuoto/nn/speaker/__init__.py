"""Speaker encoders: CAM++ built from campplus.onnx."""

from mizuoto.nn.speaker.campplus import CAMPPlus

__all__ = ["CAMPPlus"]
