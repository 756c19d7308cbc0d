"""Inject an exception at a chosen line of ``ninfer_kv`` code (tests of the rule that an
interrupt anywhere leaves a store or a follower as it was, or failed)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import ninfer_kv

PKG = str(Path(ninfer_kv.__file__).parent)


class Injector:
    """A tracer that counts the lines run in ``ninfer_kv`` code and raises
    ``KeyboardInterrupt`` at line ``at`` (0: never); ``first_emit`` is the line count when a
    function named ``first`` (the first one that changes state: ``StoreCore._emit``) was
    first entered."""

    def __init__(self, at: int, first: str = "_emit") -> None:
        self.at, self.first, self.lines, self.first_emit = at, first, 0, -1
        self.where = ""  # "function:line" of the injection

    def run(self, fn: Callable[[], Any]) -> BaseException | None:
        """Call ``fn`` traced; the exception it raised (the injected one, or another), or
        None."""
        sys.settrace(self)
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - the injected interrupt, or what it became
            return exc
        finally:
            sys.settrace(None)
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:  # noqa: ANN401
        if not frame.f_code.co_filename.startswith(PKG):
            return None
        if event == "call" and frame.f_code.co_name == self.first and self.first_emit < 0:
            self.first_emit = self.lines
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:  # noqa: ANN401
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                raise KeyboardInterrupt(f"injected at line {self.at}")
        return self.local


def lines_to_try(total: int, first_emit: int, stride: int = 11) -> list[int]:
    """Every line from a few before the first event on; before it (planning) every
    ``stride``-th."""
    dense = max(1, first_emit - 3)
    return sorted(set(range(1, dense, stride)) | set(range(dense, total + 1)))
