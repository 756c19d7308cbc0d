"""Shared CLI output helpers."""

from __future__ import annotations

import json
import sys


def emit_json(obj: object) -> None:
    """One JSON object per line on stdout."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
