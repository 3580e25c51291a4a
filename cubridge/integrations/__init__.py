"""Integrations of tuned runs with model libraries (transformers)."""
