"""Decoding: `generate` (host API, `generate.py`) over a `DecodeLoop` (`loop.py`, one
speculative step in `speculate.py`) whose typed state is `state.py`; the adaptive policy
is `policy.py` (with the verify cost model, `cost.py`), the KV commit strategies
`commit.py`, and the compiled-program cache `programs.py`. docs/design.md has the flow."""
