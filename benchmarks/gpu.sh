#!/usr/bin/env bash
# Rollout throughput on one H100/H200-class GPU, in under 8 minutes: a ~0.5B Qwen2 (Qwen2.5-0.5B's shape, built
# locally with random weights: nothing is downloaded) in bf16, a GRPO-shaped step of 16 prompts x 8 samples.
# Rows: the RolloutWorker with sdpa (what WorkerConfig's "auto" picks on a GPU), with rollout_paged, and with
# flash_attention_2 when the flash_attn wheel imports; transformers' generate_batch (fresh manager per step, its own
# GPU defaults); padded model.generate; the plain DynamicCache decode ceiling. Each worker row also reports the bf16
# logprob gap against a plain teacher-forced forward of the same weights.
#
#   benchmarks/gpu.sh                  # on the GPU machine; the report lands in $OUT/gpu_rollout.txt
#   benchmarks/gpu.sh --dry-run        # here, on CPU: the same pipeline on the tiny model, bf16, one short round
#
# Environment: PYTHON (default: python), OUT (default: /tmp/rollout-gpu-bench), LIMIT_S (default: 470).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${OUT:-${TMPDIR:-/tmp}/rollout-gpu-bench}
LIMIT_S=${LIMIT_S:-470}
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|--tiny) DRY_RUN=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --dry-run or nothing)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

WORKERS="sdpa,rollout_paged"
if "$PYTHON" -c "import flash_attn" 2>/dev/null; then
  WORKERS="$WORKERS,flash_attention_2"
else
  echo "# flash_attn is not importable: no flash_attention_2 row" >&2
fi

if [ "$DRY_RUN" = 1 ]; then
  ARGS=(--device cpu --dtype bfloat16 --size tiny --quick --num-blocks 256 --gap-rows 4)
  WORKERS="sdpa,rollout_paged"
else
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: torch sees no CUDA device (use --dry-run on a CPU machine)" >&2
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
  # 128 rows, prompts 64-256 tokens, completions 32-384: KV of 128 x 640 tokens fits 8192 pages of 16 tokens
  ARGS=(--device cuda --dtype bfloat16 --size 0.5b --prompts 16 --n 8 --prompt-min 64 --prompt-max 256
        --gen-min 32 --gen-max 384 --rounds 2 --page-size 16 --max-batch-tokens 4096 --num-blocks 8192
        --gap-rows 32)
fi

echo "# $(date -u +%FT%TZ) benchmarks/bench_rollout.py ${ARGS[*]} --workers $WORKERS" | tee "$OUT/gpu_rollout.txt"
timeout "$LIMIT_S" "$PYTHON" benchmarks/bench_rollout.py "${ARGS[@]}" --workers "$WORKERS" \
  2> >(tee "$OUT/gpu_rollout.log" >&2) | tee -a "$OUT/gpu_rollout.txt"
