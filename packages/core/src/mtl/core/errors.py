"""Exception types. The CLI prints these without a traceback (``--debug`` shows it)."""


class MtlError(Exception):
    """Base of every error mtl raises on purpose: the message says what, where and how to fix."""


class ConfigError(MtlError):
    """A config file, key or value is wrong."""


class PluginError(MtlError):
    """A plugin is missing, broken, or registers a name that another already owns."""


class NotInstalledError(PluginError):
    """A registry name was asked for that no installed distribution provides."""


class DataError(MtlError):
    """An input file (corpus, .bin/.idx, tokenizer model) is missing or malformed."""


class CheckpointError(MtlError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


class ParallelError(MtlError):
    """A parallel layout is invalid for the model or the world size."""
