"""mtl.core: the small, stable layer every other mtl package builds on."""

__version__ = "0.1.0"
