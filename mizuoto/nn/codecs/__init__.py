"""Speech codecs: the S3 speech tokenizers (v1-v3) built from their ONNX files."""
