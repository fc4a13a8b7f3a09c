"""Foreign weight formats -> torch state_dicts, converted once per model and cached."""
