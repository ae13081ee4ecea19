"""The command-line contract every `python -m muse_mlx...` command keeps.

A user error (a bad flag, file, prompt or value) prints one line, `error: <what was wrong>`, to
stderr and exits 2; Ctrl-C prints `interrupted` and exits 130; a closed stdout (output piped
into `head`) ends the command quietly with 0, as `head` expects; the system refusing a file's
bytes or a connection (a full or read-only disk, a server gone: an OSError the command did not
turn into a user error) prints one line naming the file and the cause and exits 1. Anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .errors import MuseError


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error: a bad flag raises MuseError instead of printing the usage."""

    def error(self, message):
        raise MuseError(f"{self.prog}: {message}")


def run(command: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run `command(argv)` under the contract; returns the exit status."""
    try:
        return command(argv)
    except MuseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away: point stdout at /dev/null so the interpreter's final flush
        # does not raise a second time, and leave quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        try:   # stdout itself may be what refused (a full disk behind it): no second error at exit
            sys.stdout.flush()
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1


def exit_now(status: int) -> None:
    """End the process with `status`, skipping the interpreter's teardown: Python's streams and
    log handlers flushed, then os._exit. For generate, whose teardown (MLX freeing ~19 GB of
    device memory buffer by buffer, the interpreter's) took ~0.15 s of a short run's ~4 s on the
    H200 (docs/ledger.md, 2026-12-03); and for the commands whose engine runs MLX on a worker thread
    (the server's slots, bench_serving's engine-loop cells): with MLX 0.32.4, a process that
    evaluated a prefill and a decode step on such a thread aborts in its C++ teardown at exit
    ("terminate called without an active exception", status 134), after all its work is done and
    written (2026-12-02, docs/ledger.md). Only for `python -m` entry points: never in-process."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def read_regular_file(path, limit: int) -> bytes:
    """At most limit + 1 bytes of a file named on the command line (more than `limit` tells the
    caller it is too long). Opened without blocking and refused unless a regular file: a FIFO would
    wait for a writer and a device might never end. OSError (its strerror says why) otherwise."""
    import stat

    with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(0, "not a regular file")
        return f.read(limit + 1)


def read_flag_file(flag: str, path, limit: int) -> bytes:
    """The bytes of the file a flag names (read_regular_file), at most `limit`: MuseError, one line
    naming the flag and the file, where it cannot be read or is larger."""
    try:
        data = read_regular_file(path, limit)
    except OSError as exc:
        raise MuseError(f"{flag} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        size = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit // 1024} KiB"
        raise MuseError(f"{flag} {path}: more than {size}")
    return data


def ints(text: str, flag: str) -> list[int]:
    """A comma-separated list of integers, as flags like --depths take them."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise MuseError(f"{flag}: expected comma-separated integers, got {text!r}") from None
