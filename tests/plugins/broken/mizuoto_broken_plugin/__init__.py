"""Deliberately broken mizuoto plugins, for tests."""
