"""The trace's ideal prefix reuse, shared with benchmarks/prefix_reuse_bench.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from prefix_reuse_bench import ideal_hit_ratio  # noqa: E402

__all__ = ["ideal_hit_ratio"]
