"""The package version, in a module of its own so that any layer can read it without importing
cubridge/__init__.py (which imports the public API, the top layer)."""
__version__ = "0.1.0"
