"""Offline re-scoring: exact teacher-forced logprobs of stored (prompt, completion) pairs, packed and padding-free.

May import torch, transformers' public model, attention and mask interfaces, and rollout's leaf modules (`errors`, `moe`,
and `loading` for a checkpoint path); never the continuous-batching engine (tests/test_layout.py checks it). Files: `score.py` (the API), `packing.py` (packing
pairs into padding-free batches with a block-diagonal mask).
"""

from .score import DEFAULT_MAX_BATCH_TOKENS, TokenScores, check_pairs, score, score_details, score_iter

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "TokenScores", "check_pairs", "score", "score_details", "score_iter"]
