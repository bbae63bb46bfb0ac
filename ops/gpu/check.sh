#!/usr/bin/env bash
# One-shot GPU check, for the few minutes a GPU machine is lent: from the repository alone (torch with
# CUDA installed; anything else from wheels in $FERRY_WHEELS), within 8 minutes on one GPU:
#   kernels  the Triton kernel tests compiled for CUDA (every head dim / block size / dtype case)
#   parity   the engine with attention=triton vs torch, token for token; the GPU-path unit tests
#   model    a Llama-3.2-1B-shaped random bf16 checkpoint (ferry make-model --size 1b)
#   decode   decode-step bandwidth as a fraction of the card's peak (measured copy + datasheet),
#            the timed forwards under torch.cuda.set_sync_debug_mode('error')
#   kvcopy   KV blocks copied out and in on the side stream while the engine decodes: the copies must
#            overlap the steps, the engine thread must not wait for them, the blocks byte-identical
#   bench    ferry bench --offline, dynamic vs static batching, on that checkpoint
# The steps share a budget (FERRY_CHECK_BUDGET_S, default 450 s): each step's timeout is cut to what is left.
# Results: JSON under $OUT (summary.json: each step's exit status and seconds, plus the step's own
# JSON / junit XML); the exit status is non-zero when any step failed. Usage:
#   OUT=/tmp/gpu-check bash ops/gpu/check.sh [--dry] [--steps kernels,parity,model,decode,kvcopy,bench]
# --dry: the same steps on the CPU with the tiny model and tiny workloads (CI runs it for decode,kvcopy,bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-check}
DRY=0
STEPS=kernels,parity,model,decode,kvcopy,bench
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1 ;;
    --steps) STEPS=$2; shift ;;
    *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD/libs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${FERRY_WHEELS:-}" ]; then  # a bare machine: the dependencies came along as wheels
  "$PY" -m pip install -q --no-index --find-links "$FERRY_WHEELS" "$FERRY_WHEELS"/*.whl || exit 3
fi
if [ "$DRY" = 1 ]; then
  DEVICE=cpu SIZE=tiny DTYPE=float32 BATCHES=1,4 CONTEXT=64 STEPS_N=5 COPY_MB=64 REQUESTS=8 MAXOUT=16 VOCAB=512 PROMPT=16
  KV_BATCH=4 KV_BLOCKS=4
else
  DEVICE=cuda SIZE=1b DTYPE=bfloat16 BATCHES=1,8,32,64 CONTEXT=512 STEPS_N=50 COPY_MB=2048 REQUESTS=64 MAXOUT=256 VOCAB=2048 PROMPT=100
  KV_BATCH=32 KV_BLOCKS=256
fi
CKPT="$OUT/model-$SIZE"
declare -A RC SECS

BUDGET_S=${FERRY_CHECK_BUDGET_S:-450}  # the whole run ends within this (+ the summary): 8 minutes with setup
DEADLINE=$((SECONDS + BUDGET_S))

run_step() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left  # a step never runs past the budget: it times out (rc 124)
  echo "== $name (at most ${limit}s)" >&2
  local start=$SECONDS
  if [ "$limit" -gt 0 ]; then
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    RC[$name]=$?
  else
    echo "check.sh: no time left in the ${BUDGET_S}s budget" >"$OUT/$name.log"
    RC[$name]=124
  fi
  SECS[$name]=$((SECONDS - start))
  tail -n 3 "$OUT/$name.log" >&2
}

pytest_step() {  # name timeout_s test files...
  local name=$1 limit=$2; shift 2
  run_step "$name" "$limit" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" --junitxml="$OUT/$name.xml" "$@"
}

"$PY" - >"$OUT/env.json" <<'PYEOF'
import json, torch, triton
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "capability": list(torch.cuda.get_device_capability()) if cuda else None}))
PYEOF
pytest_step kernels 150 tests/unit/test_kernels.py tests/unit/test_kernel_matrix.py
pytest_step parity 120 tests/unit/test_engine_triton.py tests/unit/test_gpu_path.py tests/unit/test_moe_grouped.py
run_step model 150 "$PY" -m ferry.cli make-model --arch llama --size "$SIZE" --dtype "$DTYPE" "$CKPT"
run_step decode 90 "$PY" -m ferry.bench.decode_bandwidth --model "$CKPT" --device "$DEVICE" --batch "$BATCHES" \
  --context "$CONTEXT" --steps "$STEPS_N" --copy-mb "$COPY_MB" --out "$OUT/decode.json"
run_step kvcopy 90 "$PY" -m ferry.bench.kv_copy_overlap --model "$CKPT" --device "$DEVICE" --batch "$KV_BATCH" \
  --context "$CONTEXT" --blocks "$KV_BLOCKS" --rounds "$STEPS_N" --out "$OUT/kvcopy.json"
run_step bench 180 "$PY" -m ferry.cli bench --offline --model "$CKPT" --device "$DEVICE" --systems dynamic,static \
  --num-requests "$REQUESTS" --output-lens "16,32,64,$MAXOUT" --vocab-size "$VOCAB" --prompt-len-median "$PROMPT" --max-prompt-len $((PROMPT * 8)) --rate-fractions "" \
  --threads 4 --no-progress --out "$OUT/bench"

rm -rf "$CKPT"  # gigabytes of random weights: not worth bringing back
"$PY" - "$OUT" "$DRY" "${!RC[@]}" -- "${RC[@]}" -- "${SECS[@]}" <<'PYEOF'
import json, sys
out, dry, rest = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
first = rest.index("--"); second = rest.index("--", first + 1)
names, rcs, secs = rest[:first], rest[first + 1:second], rest[second + 1:]
steps = {n: {"rc": int(r), "seconds": int(s)} for n, r, s in zip(names, rcs, secs)}
summary = {"dry": dry, "env": json.load(open(f"{out}/env.json")), "steps": steps,
           "ok": all(s["rc"] == 0 for s in steps.values())}
for name, file in (("decode", "decode.json"), ("kvcopy", "kvcopy.json"), ("bench", "bench/report.json")):
    try:
        report = json.load(open(f"{out}/{file}"))
    except (OSError, ValueError):
        continue
    if name == "kvcopy":
        summary[name] = report
        continue
    summary[name] = report["runs"] if name == "decode" else {"ratios": report.get("ratios"), "offline": {
        k: {m: v.get(m) for m in ("output_tokens_per_s", "requests_per_s", "e2e_ms", "tpot_ms")}
        for k, v in report.get("offline", {}).items()}}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
PYEOF
