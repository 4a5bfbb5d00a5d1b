"""What the engine's device allows: how big the KV cache is and what a CUDA device turns on.

- sizing.py: the cache's pages from WorkerConfig and the device's free memory; the longest request it holds;
- cuda.py: on a CUDA device, flash where it imports, the decode fast path, CUDA graphs and async batching.

May import: rollout's `base`, and the engine's `upstream` (the memory plan, the attention a model runs).
"""
