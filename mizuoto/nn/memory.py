"""Terms every block's call figure shares (`nn.flow.memory`, `nn.vocoders.memory`, the engines' LM figures)."""

from __future__ import annotations

FLOAT = 4
# On the CPU a call's buffers under the mmap threshold (1 MiB, runtime.malloc) come from glibc's heap,
# whose packing depends on what the process ran before: the same full-size call measured up to 12 MiB
# more in one fresh process than in another (docs/memory.md, "Calibration"). Each figure carries this
# allowance, so it bounds the call in any process; the calibration band is held without it.
HEAP_PACKING_BYTES = 16 << 20
FIXED_BYTES = (1 << 20) + HEAP_PACKING_BYTES  # what any call allocates whatever its size, and the allowance
