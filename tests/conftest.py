"""Suite-wide setup: fixtures must exist, and the thread count is pinned for parity."""

import torch

from mizuoto.testing.fixtures import fixtures_root

# Fixtures were recorded with 2 threads; float reductions can depend on the thread count.
torch.set_num_threads(2)
fixtures_root()  # raises at collection if the fixture tree is missing
