"""An example third-party mtl plugin."""
