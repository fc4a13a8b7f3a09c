"""Speech codecs: the S3 speech tokenizers (v1-v3) built from their ONNX files."""

from mizuoto.nn.codecs.s3tokenizer import S3Tokenizer

__all__ = ["S3Tokenizer"]
