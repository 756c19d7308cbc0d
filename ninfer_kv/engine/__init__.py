"""The store: state, ``apply``, the commands and the GPU boundary.

``apply`` guards every event it applies with ``assert`` statements (a foreign or damaged
journal is refused before any array is written) and the compiled kernels after those checks
do not bounds-check. ``python -O`` strips the statements, so a damaged event would be written
through them: the engine refuses to load rather than run without its checks (assertions stay
on in production, as in TigerBeetle).

The compiled kernels also read journaled int32 fields in place (``apply_kernels.int32s``) and
the decode round writes them as native int32: the journal is little-endian, so the engine
refuses to load on a big-endian machine rather than read every id byte-swapped.
"""

import sys

if not __debug__:
    raise ImportError("ninfer_kv.engine needs its assertions: python -O (PYTHONOPTIMIZE) strips "
                      "the checks apply() runs on every journaled event, and the compiled "
                      "kernels behind them do not bounds-check; run without -O")
if sys.byteorder != "little":
    raise ImportError(f"ninfer_kv.engine needs a little-endian machine (this one is "
                      f"{sys.byteorder}-endian): the journal's int32 fields are read in place")
