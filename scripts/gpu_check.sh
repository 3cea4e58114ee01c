#!/usr/bin/env bash
# One command on a GPU machine (issue "Run on real GPUs"): build, test, train, check, benchmark.
#
#   bash scripts/gpu_check.sh [STAGE ...]
#       STAGE: build tests smoke compile fp8 multirank sync bench (default: all)
#
# Writes bench/results/<device>-<UTC time>-tests.txt (the test summary lines), -checks.json (smoke,
# compile (tokens/s eager vs train.compile), fp8 (tokens/s per train.fp8 recipe vs none),
# multi-rank and sync reports) and, from
# `python -m bench`, <device>-<UTC time>.json. Stages run on past a failure; the exit code is
# non-zero if any failed. Every stage fits a 10-minute device call on one H100 when run alone;
# XORL_BENCH_ARGS (default --quick) and XORL_PYTEST_ARGS pass options on.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests smoke compile fp8 multirank sync bench)
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"  # a preinstalled CUDA torch is reused, offline (see setup_env.sh)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
results="$root/bench/results"
mkdir -p "$results"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
slug="$(python -c 'import torch; from bench.device_info import device_slug; print(device_slug(torch.device("cuda")))')"
prefix="$results/$slug-$stamp"
work="$(mktemp -d)"
failed=()
run() {  # run NAME CMD...: time it, keep going on failure
  local name="$1"; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@"; then echo "=== $name: ok ($((SECONDS - t0)) s)"; else echo "=== $name: FAILED ($((SECONDS - t0)) s)"; failed+=("$name"); fi
}

if want build; then
  run build python -c "
import torch, xorl_kernels
assert torch.cuda.is_available(), 'no CUDA device'
print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'cuda', torch.version.cuda)
assert xorl_kernels.has_cuda_ext(), 'xorl_kernels._C did not build or load'
print('xorl_kernels._C loaded')"
fi

if want tests; then
  # The whole suite; the gpu-marked tests run because CUDA is present.
  run tests bash -c "python -m pytest -q -rfEs tests ${XORL_PYTEST_ARGS:-} 2>&1 | tee '$work/pytest.log'"
  grep -E '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)|[0-9]+ (passed|failed)|error' "$work/pytest.log" >"$prefix-tests.txt" || true
fi

checks=()
if want smoke; then
  for model in dense moe; do
    run "smoke-$model" python scripts/gpu_check.py smoke --model "$model" --out "$work/smoke-$model.json"
    checks+=("$work/smoke-$model.json")
  done
fi

if want compile; then
  # Tokens per second of the smoke runs eager and with train.compile: true (inductor, per block).
  for model in dense moe; do
    run "compile-$model" python scripts/gpu_check.py compile --model "$model" --out "$work/compile-$model.json"
    checks+=("$work/compile-$model.json")
  done
fi

if want fp8; then
  # Tokens per second of the smoke runs with each train.fp8 recipe against fp8: none (issue 22).
  for model in dense moe; do
    run "fp8-$model" python scripts/gpu_check.py fp8 --model "$model" --out "$work/fp8-$model.json"
    checks+=("$work/fp8-$model.json")
  done
fi

if want multirank; then
  # Four ranks on the one GPU under "cuda:gloo": a process group with a backend for CUDA tensors
  # only, like NCCL (which refuses two ranks on one GPU), so any collective on a CPU tensor fails.
  # gloo moves CUDA tensors for all-reduce, all-gather, reduce-scatter and all-to-all, not for
  # point-to-point, so these layouts avoid ring attention, pipelining and the overlapped TP ring.
  common=(--train.max_steps=8 --train.save_steps=0 --train.log_steps=4 --train.dtype=bfloat16
          --model.attn_implementation=xorl --train.ringattn_parallel_size=1)
  export XORL_DIST_BACKEND=cuda:gloo
  run multirank-moe-fsdp2-ulysses2-ep4 torchrun --standalone --nproc_per_node=4 -m xorl.cli.train \
      "${common[@]}" --train.data_parallel_shard_size=2 --train.ulysses_parallel_size=2 \
      --train.expert_parallel_size=4 --train.output_dir="$work/mr-moe"
  run multirank-dense-fsdp2-tp2-sp torchrun --standalone --nproc_per_node=4 -m xorl.cli.train \
      "${common[@]}" --model.model_type=llama --model.num_experts=0 --train.expert_parallel_size=1 \
      --train.data_parallel_shard_size=2 --train.tensor_parallel_size=2 --train.sequence_parallel=true \
      --train.tp_overlap=false --train.output_dir="$work/mr-dense"
  unset XORL_DIST_BACKEND
fi

if want sync; then
  for model in dense moe; do
    run "sync-$model" python scripts/gpu_check.py sync --model "$model" --out "$work/sync-$model.json"
    checks+=("$work/sync-$model.json")
  done
fi

if [ ${#checks[@]} -gt 0 ]; then
  python - "$prefix-checks.json" "${checks[@]}" <<'PY'
import json, os, sys
out, files = sys.argv[1], sys.argv[2:]
reports = {os.path.basename(f)[:-5]: json.load(open(f)) for f in files if os.path.exists(f)}
json.dump(reports, open(out, "w"), indent=2)
print("checks ->", out)
PY
fi

if want bench; then
  # shellcheck disable=SC2086
  run bench python -m bench ${XORL_BENCH_ARGS:---quick} --out "$results"
fi

rm -rf "$work"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED stages: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all stages passed (${stages[*]})"
