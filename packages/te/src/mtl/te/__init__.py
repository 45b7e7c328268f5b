"""mtl-te: the Transformer Engine backend (``model.backend = "te"``).

Importing ``mtl.te`` (and its plugin) never needs Transformer Engine; ``mtl.te.modules``
does, and without it raises ``NotInstalledError`` with one line naming what to install.
"""
