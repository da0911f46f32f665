"""Errors that ftengine raises for expected problems (bad input, bad files, bad options).

The CLI prints these as one line and exits non-zero; anything else is a bug.
"""


class FtengineError(Exception):
    """Base class: an expected problem, described for the user."""


class ConfigError(FtengineError):
    """config.json (or another settings file) is missing, malformed or unsupported."""


class CheckpointError(FtengineError):
    """The weight files are missing, corrupt, or do not match the config."""


class InputError(FtengineError):
    """The user's texts, prompts or options are not acceptable."""


class OutputError(FtengineError):
    """The output cannot be created, written or put in place."""


class DeviceError(FtengineError):
    """The requested device or dtype cannot be used here."""
