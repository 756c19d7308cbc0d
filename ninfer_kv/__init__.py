"""ninfer-kv."""
