"""An example third-party mtl plugin that adds a model family."""
