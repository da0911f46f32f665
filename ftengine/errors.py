"""Errors that ftengine raises for expected problems (bad input, bad files, bad options), and the
notices it prints once on stderr.

The CLI prints these as one line and exits non-zero; anything else is a bug.
"""

import sys
import threading

_said = set()  # the notices already printed
_said_lock = threading.Lock()


def say_once(text: str):
    """Print a notice on stderr, the first time it comes up in this process only."""
    with _said_lock:
        if text in _said:
            return
        _said.add(text)
    print(text, file=sys.stderr)


class FtengineError(Exception):
    """Base class: an expected problem, described for the user."""


class ConfigError(FtengineError):
    """config.json (or another settings file) is missing, malformed or unsupported."""


class CheckpointError(FtengineError):
    """The weight files are missing, corrupt, or do not match the config."""


class InputError(FtengineError):
    """The user's texts, prompts or options are not acceptable."""


class TooLongError(InputError):
    """A text is longer than max_length and truncation is off; `index` is its 0-based place in
    the request, `max_length` the limit, `length` its tokens where known."""

    def __init__(self, message: str, *, index: int, max_length: int, length: int | None = None):
        super().__init__(message)
        self.index = index
        self.max_length = max_length
        self.length = length


class PromptError(InputError):
    """A prompt that cannot run: `index` is its 0-based place in the call, `reason` what is wrong
    with it (the message reads "prompt N <reason>")."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"prompt {index + 1} {reason}")
        self.index = index
        self.reason = reason


class OutputError(FtengineError):
    """The output cannot be created, written or put in place."""


class DeviceError(FtengineError):
    """The requested device or dtype cannot be used here."""
