"""Stress harness for issue 17: no wrong KV when the engine is busy.

Many concurrent greedy requests through the real vLLM engine with a small G1 (preemptions),
prefix caching, shared prefixes and a small G2/G3 (blocks move through every tier), each
output compared token by token with the same requests served by vLLM without a connector,
optionally with faults injected into the kvbm node during the run. See ``README.md`` here.

Runs in the kvbm venv; the engine itself runs in the vLLM venv (``engine.py``, a script).
"""
