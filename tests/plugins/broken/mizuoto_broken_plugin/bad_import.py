"""Fails at import, as a plugin with a missing dependency would."""

raise ImportError("deliberately broken plugin: a dependency is missing")
