"""Speaker encoders: CAM++ (built from campplus.onnx) and an LSTM encoder over mel windows."""

from mizuoto.nn.speaker.campplus import CAMPPlus
from mizuoto.nn.speaker.lstm_encoder import LSTMSpeakerEncoder

__all__ = ["CAMPPlus", "LSTMSpeakerEncoder"]
