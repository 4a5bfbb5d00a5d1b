"""CPU kernels for the engine's fp32 forward: what a step spends its time in, made faster with the same numbers.

- native.py: builds and loads the C kernels (gcc, on first use, cached per machine); openmp.py: hands them torch's
  OpenMP team and lets a caller's idle pool go;
- decode_kernel.py (+ .c): the paged decode attention and the KV write, reading the cache where it lies;
- elementwise.py (+ .c): RMSNorm and rotary fused, bit for bit torch's;
- onednn.py: the fp32 linears on oneDNN, with each engine's packed weights (`PackedWeights`).
Nothing here patches anything: the engine hands these forwards to `upstream.install_linear` / `install_fused`.

May import: torch and transformers' public modeling code; nothing of rollout.
"""
