"""argparse value types that refuse out-of-range input at parse time, and the parser class
whose errors are one ``error:`` line and exit code 2 (never a usage dump or a traceback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        raise SystemExit(2)


def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}" + (
                f" and <= {hi}" if hi is not None else ""))
        return v

    parse.__name__ = f"integer >= {lo}" if hi is None else f"integer in [{lo}, {hi}]"
    return parse


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, 1]")
    return v


non_negative = int_at_least(0)
positive = int_at_least(1)


FROM_SNAPSHOT_HELP = ("read from the newest usable snapshot, as the store's recovery does "
                      "(default: check the whole log from its first record)")
