"""Foreign weight formats -> torch state_dicts, converted once per model and cached."""

from mizuoto.runtime.convert.onnx import (
    CONVERTER_VERSION,
    OnnxGraph,
    Src,
    extract_state_dict,
    load_converted,
    load_graph,
    stderr_progress,
)

__all__ = ["CONVERTER_VERSION", "OnnxGraph", "Src", "extract_state_dict", "load_converted", "load_graph",
           "stderr_progress"]
