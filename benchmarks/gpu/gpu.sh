#!/usr/bin/env bash
# The H200 run in one go (about 7 minutes, the machine's start aside; the device window is 15), everything under $OUT:
#   1. python: transformers 5.23.0 (the pinned wheel, carried in wheels/, installed into a venv over the machine's
#      own torch when its transformers differs), pytest, psutil;
#   2. tests on CUDA: tests/test_gpu.py (exactness with the CUDA defaults with and without CUDA graphs, fp32 and
#      bf16; sleep returning the KV cache; fraction budgets; fingerprints across devices), then the CPU suite's
#      fast files, on this machine                                                   -> gpu_tests.txt
#   3. throughput: bench_rollout.py on a Qwen2.5-0.5B-shaped bf16 model (random weights, built locally), a GRPO step
#      of 16 prompts x 8 samples: the worker ("auto": flash when it imports, else rollout_paged),
#      transformers' generate_batch (its own GPU defaults: flash switch, CUDA graphs, async), padded generate, the
#      DynamicCache decode ceiling and the bandwidth bound (weights + KV once per step at 4.8 TB/s) -> gpu_rollout.txt
#   4. colocation: sleep/wake memory and times, the device fingerprint of 7.6B bf16 parameters -> gpu_colocation.txt
#   5. exactness: bf16 / fp32 logprob gaps per engine attention against a plain forward (init std 0.02, the exactness
#      rule's)                                                                      -> gpu_exactness.txt
#   6. speculation: bench_speculative.py's oracle workload on CUDA (fp32 25m and 100m Llamas, drafts that are right,
#      1 / 4 / 16 / 64 rows): off vs "auto" vs "always"                              -> gpu_speculation.txt
#
#   benchmarks/gpu/gpu.sh                  # on the GPU machine (run tool: carry ["wheels"])
#   benchmarks/gpu/gpu.sh --dry-run        # here, on CPU: every step on tiny sizes (test_gpu.py skips itself)
#   benchmarks/gpu/gpu.sh --fetch-wheels   # where a package index is reachable: fill wheels/ (git-ignored, ~25 MiB)
#
# Environment: PYTHON (default: python3), OUT (default: /tmp/rollout-gpu-bench), WHEELS (default: wheels),
# FORCE_VENV=1 (install the wheels into a venv even when transformers is already 5.23.0: dry-runs that path).
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/rollout-gpu-bench}
WHEELS=${WHEELS:-wheels}
TRANSFORMERS=5.23.0
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|--tiny) DRY_RUN=1 ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (use --dry-run, --fetch-wheels or nothing)" >&2; exit 2 ;;
  esac
done

fetch_wheels() {  # pure-Python wheels once; binary ones (abi3, or per Python version) for Linux x86_64
  mkdir -p "$WHEELS"
  "$PYTHON" -m pip download -q --no-deps --dest "$WHEELS" "transformers==$TRANSFORMERS" "huggingface_hub==1.31.0" \
    click filelock fsspec httpx httpcore h11 anyio sniffio idna certifi typing_extensions packaging tqdm \
    pytest pluggy iniconfig pygments
  for py in 3.10 3.11 3.12 3.13; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version "$py" \
      --dest "$WHEELS" "regex>=2025.10.22" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8.0" hf-xet psutil pyyaml
  done
  du -sh "$WHEELS"
}
if [ "${FETCH:-0}" = 1 ]; then fetch_wheels; exit $?; fi

mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
: > "$LOG"
say() { echo "# $(date -u +%T) $*" | tee -a "$LOG" >&2; }

setup_python() {  # -> PYTHON runs transformers $TRANSFORMERS with pytest and psutil
  local ok="import sys, transformers, pytest, psutil; sys.exit(transformers.__version__ != '$TRANSFORMERS')"
  if [ "${FORCE_VENV:-0}" != 1 ] && "$PYTHON" -c "$ok" 2>/dev/null; then return 0; fi
  if ! ls "$WHEELS"/transformers-"$TRANSFORMERS"-*.whl >/dev/null 2>&1; then
    say "no transformers $TRANSFORMERS here and no wheel in $WHEELS/ (run benchmarks/gpu/gpu.sh --fetch-wheels where an" \
        "index is reachable, then carry wheels/)"
    return 1
  fi
  local venv="${VENV:-${TMPDIR:-/tmp}/rollout-gpu-venv}" pip=()
  say "installing transformers $TRANSFORMERS from $WHEELS/ into $venv (over this Python's own packages)"
  if "$PYTHON" -m venv "$venv" >>"$LOG" 2>&1; then
    pip=("$venv/bin/python" -m pip)
  else  # no ensurepip: a bare venv, filled by this Python's pip
    "$PYTHON" -m venv --without-pip "$venv" >>"$LOG" 2>&1 || return 1
    pip=("$PYTHON" -m pip --python "$venv/bin/python")
  fi
  # this Python's own packages (torch, numpy, ...) stay visible behind the venv's: a .pth of its site directories
  # (works where --system-site-packages does not: when this Python is itself a venv)
  "$PYTHON" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer.pth"
  "${pip[@]}" install -q --no-index --find-links "$WHEELS" "transformers==$TRANSFORMERS" pytest psutil >>"$LOG" 2>&1 \
    || return 1
  PYTHON="$venv/bin/python"
  "$PYTHON" -c "$ok" 2>>"$LOG"
}

step() {  # step NAME LIMIT_S OUTFILE COMMAND...: runs under a time limit, keeps going whatever it returns
  local name=$1 limit=$2 file=$3
  shift 3
  say "$name (limit ${limit}s) -> $file"
  echo "# $(date -u +%FT%TZ) $*" > "$OUT/$file"
  timeout "$limit" "$@" >>"$OUT/$file" 2>>"$LOG"
  local rc=$?
  say "$name: exit $rc"
  tail -n 25 "$OUT/$file" >&2
  return 0
}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
setup_python || { say "python setup failed: see $LOG"; exit 1; }
say "python: $PYTHON; $("$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
  torch.version.cuda, "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name() if
  torch.cuda.is_available() else "-")' 2>&1)"
FLASH=$("$PYTHON" -c "from rollout.engine.device import cuda; print(cuda.flash_attn_imports())" 2>>"$LOG")
say "flash_attn imports: $FLASH"

if [ "$DRY_RUN" = 1 ]; then
  BENCH=(--device cpu --dtype bfloat16 --size tiny --quick --num-blocks 256 --gap-rows 4 --bandwidth-tbs 4.8
         --workers auto,sdpa)
  COLOCATION=(--dry-run)
  EXACT=(--device cpu --size tiny --dtypes bfloat16,float32 --max-new-tokens 8 --kv-mb 64)
  TESTS=(tests/test_gpu.py tests/test_cuda.py tests/test_sampler.py)
  SPECULATION=(--workloads oracle --device cpu --oracle-sizes tiny --rounds 1)
else
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch sees no CUDA device (use --dry-run on a CPU machine)"
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1 || true
  # 128 rows, prompts 64-512 tokens, completions 32-256, in 32768 pages of 16 tokens: 84 s on the H200 of
  # 2026-12-04, where every engine ran at the eager per-step launch rate (~50 ms a 0.5B step); 256 rows of up to 512
  # tokens, two rounds and two workers did not finish in 240 s
  BENCH=(--device cuda --dtype bfloat16 --size 0.5b --prompts 16 --n 8 --prompt-min 64 --prompt-max 512
         --gen-min 32 --gen-max 256 --rounds 1 --page-size 16 --max-batch-tokens 8192 --num-blocks 32768
         --gap-rows 16 --bandwidth-tbs 4.8 --workers auto)
  COLOCATION=()
  EXACT=(--device cuda --size 100m --dtypes bfloat16,float32)
  TESTS=(tests/test_gpu.py tests/test_cuda.py tests/test_sampler.py tests/test_sizing.py tests/test_config.py
         tests/test_upstream_contract.py tests/test_reproducibility.py)
  SPECULATION=(--workloads oracle --device cuda --oracle-sizes 25m,100m --rounds 1)  # 89 s on 2026-12-04
fi

step "tests" 120 gpu_tests.txt "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider "${TESTS[@]}"
step "throughput" 240 gpu_rollout.txt "$PYTHON" benchmarks/throughput/bench_rollout.py "${BENCH[@]}"
step "colocation" 90 gpu_colocation.txt "$PYTHON" benchmarks/gpu/gpu_colocation.py "${COLOCATION[@]}"
step "exactness" 90 gpu_exactness.txt "$PYTHON" benchmarks/gpu/gpu_exactness.py "${EXACT[@]}"
step "speculation" 150 gpu_speculation.txt "$PYTHON" benchmarks/speculation/bench_speculative.py "${SPECULATION[@]}"
say "done: $(ls "$OUT")"
