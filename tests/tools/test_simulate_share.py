"""``simulate --share``: a request that arrives while another with the same prompt prefix
is still decoding continues from it (live sharing), which the default never does."""

from __future__ import annotations

import dataclasses

from ninfer_kv.tools.simulate import Request, SimOptions, simulate


def test_a_request_arriving_mid_decode_reuses_the_running_prompt() -> None:
    shared = (1, 2, 3)  # three 512-token blocks in common
    reqs = [Request(0, 0, 1600, 200, shared + (10,)),
            Request(1, 100, 1700, 20, shared + (11,))]  # arrives while request 0 decodes
    opts = SimOptions(max_concurrency=4, max_context=4096, kv_tokens=64 * 256)
    hits = {}
    for share in (False, True):
        store, res = simulate(reqs, dataclasses.replace(opts, share=share))
        store.check_invariants()
        store.close()
        hits[share] = res.prefix_hit_tokens
    assert hits == {False: 0, True: 3 * 512}
