"""Mamba-2: the SSD scan (``ssd.py``, kernel choice in ``dispatch.py``) and the mixer layer."""
