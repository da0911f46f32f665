"""What every `ftengine` command shares: one-line errors, the exit status of Ctrl-C, SIGTERM and a
reader that goes away, checks of text options, and the summary line's rates."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

import click

from .errors import FtengineError, InputError
from .textio import unicode_text


def fail(message: str):
    click.echo(f"ftengine: error: {message}", err=True)
    sys.exit(1)


BROKEN_PIPE_EXIT = 128 + 13  # as a process killed by SIGPIPE, the way `yes | head` ends for the shell


class Commands(click.Group):
    """The command group: a reader that goes away (`ftengine encode ... | head`) stops any command
    quietly with BROKEN_PIPE_EXIT, as Unix filters do."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            try:  # the interpreter's last flush of stdout must not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            sys.exit(BROKEN_PIPE_EXIT)


def text_option(value, name: str, *, empty: bool = False):
    """A text option's value, refused where it is not valid Unicode (invalid UTF-8 on the command
    line reaches Python as lone surrogates), or empty (white space alone) unless `empty`."""
    if value is not None:
        if not empty and not value.strip():
            raise InputError(f"{name} is empty")
        unicode_text(value, name, "strict", hint=" (the command line's bytes are not valid UTF-8)")
    return value


def rate(count: float, seconds: float) -> str:
    """count / seconds for a summary: whole numbers, three significant digits below 100."""
    rate = count / seconds if seconds > 0 else 0.0
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every cleanup runs as for Ctrl-C."""


def raise_terminated(signum, frame):
    raise Terminated()


@contextmanager
def sigterm_unwinds():
    """While the body runs, SIGTERM unwinds the stack (temporary files removed) instead of
    killing the process where it stands."""
    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_behind(error: BaseException):
    """The KeyboardInterrupt or Terminated that error is or was raised from, else None. A signal
    can arrive inside a library's C code, which may hand it back wrapped: Ray's CoreWorker.wait
    raises SystemError("... returned a result with an exception set") from the handler's exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, Terminated)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def exits_when_stopped(*, lead: str = "", note: str = "", on_stop=None):
    """While the body runs, Ctrl-C exits with 130 and SIGTERM with 143 (after every cleanup on
    the way out, then `on_stop()` if given), each with one line on stderr: `lead`, what happened,
    `note`."""
    try:
        with sigterm_unwinds():
            yield
    except SystemExit:
        raise
    except BaseException as e:
        stop = stop_behind(e)
        if stop is None:
            raise
        if on_stop is not None:
            on_stop()
        terminated = isinstance(stop, Terminated)
        click.echo(f"{lead}ftengine: {'terminated' if terminated else 'interrupted'}{note}", err=True)
        sys.exit(143 if terminated else 130)


def close_engine(engine):
    """Cancel an Encoder's or Reranker's work in flight and free it (None: nothing yet)."""
    if engine is not None:
        engine.close(cancel=True)


@contextmanager
def closes_on_failure(close):
    """The body of a command that drives an engine: on Ctrl-C or SIGTERM (exits_when_stopped),
    on an FtengineError (then one line, exit status 1) and on a reader that went away (re-raised
    for Commands), `close()` runs first."""
    try:
        with exits_when_stopped(on_stop=close):
            yield
    except FtengineError as e:
        close()
        fail(str(e))
    except BrokenPipeError:
        close()
        raise
