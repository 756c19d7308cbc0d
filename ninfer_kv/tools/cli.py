"""The ``ninfer-kv`` command line. Every command has ``--help`` and ``--json``.

Errors — a ``KVStoreError``, an ``OSError`` (a missing trace, an unreadable file) or an
argument out of range — become one ``error:`` line on stderr and exit code 2, never a
traceback and never exit 0. The library's log lines (a torn tail cut, a snapshot skipped) are
held while a command runs: printed to stderr after it succeeds (or is ended by SIGTERM or
Ctrl-C), dropped when it fails, so the error stays one line (what they said is in the error or
the command's own output); past ``LogSink.HOLD_MAX`` they stream as they come.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from rich.console import Console

from ninfer_kv import LOG_SINK
from ninfer_kv.errors import KVStoreError
from ninfer_kv.tools.argtypes import OneLineParser

Handler = Callable[[argparse.Namespace, Console], int]
_COMMANDS: dict[str, Handler] = {}


def build_parser() -> argparse.ArgumentParser:
    from ninfer_kv.tools import journal_cmds, plan_cmd, run_cmds

    parser = OneLineParser(prog="ninfer-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    name, handler = plan_cmd.register(sub)
    _COMMANDS[name] = handler
    _COMMANDS.update(journal_cmds.register(sub))
    _COMMANDS.update(run_cmds.register(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if not __debug__:  # ninfer_kv.engine refuses to load without its assertions: say so once
        sys.stderr.write("error: ninfer-kv needs its assertions; run it without python -O "
                         "(PYTHONOPTIMIZE)\n")
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(stderr=False)
    held: list[str] = []
    LOG_SINK.held = held
    previous = None
    if threading.current_thread() is threading.main_thread():  # a SIGTERM (timeout, systemd)
        previous = signal.signal(signal.SIGTERM, _terminated)  # unwinds: held lines written
    try:
        code = _COMMANDS[args.command](args, console)
    except BrokenPipeError:  # `ninfer-kv dump DIR | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KVStoreError, OSError) as exc:
        held.clear()
        what = type(exc).__name__
        text = " ".join(str(exc).split())  # one line, whatever the message holds
        sys.stderr.write(f"error: {what}: {text}\n")
        return 2
    finally:
        LOG_SINK.held = None
        sys.stderr.write("".join(held))
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # the shell's code for a process ended by the signal


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
