"""GPT family and model specs, HF converters"""

__version__ = "0.1.0"
