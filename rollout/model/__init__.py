"""The model the rollout side holds: `loading.py` (the one checkpoint loader and its dtype rule, the pad-id fallback),
`weights.py` (validated atomic updates, the version check, the fingerprint), `adapters.py` (PEFT adapters: names,
exact merge, adapter-only state dicts). May import: torch, transformers' public API (lazily), rollout.base, and the
engine's counter-based hash (`engine.streams`, which the fingerprint shares) (tests/test_layout.py checks it).
"""
