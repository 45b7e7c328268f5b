"""the mtl training loop"""

__version__ = "0.1.0"
