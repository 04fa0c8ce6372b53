#!/usr/bin/env bash
# The GPU check (issue 46): one call on a lent GPU machine runs every part below, each
# under its own timeout, and leaves what it measured under $OUT. A failed or timed-out
# part does not stop the others. On a machine without CUDA every CUDA part prints
# "skipped: no CUDA" and the driver still ends with its summary.
#
#   OUT=/tmp/gpucheck_out bash benchmarks/gpu_check.sh          # from the repo root
#
# $OUT gets few files on purpose (a lent machine returns at most 8): summary.txt,
# summary.json, env.txt and parts.tar.gz (every part's log and JSON), the tarball and
# summary rebuilt after each part so that a run cut short still returns them.
# GPU_CHECK_BUDGET (seconds, default 470) caps the whole run: each part's timeout is
# cut to what is left. GPU_CHECK_ONLY="reshard fenced" runs only those parts.
# GPU_CHECK_CPU=1 runs the CUDA parts on CPU at small sizes (a logic dry run).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpucheck_out}
PARTS=${GPU_CHECK_PARTS:-$(mktemp -d /tmp/gpucheck-parts-XXXXXX)}
export GPU_CHECK_PARTS=$PARTS PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT" "$PARTS"
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-470}
PY=${PYTHON:-python3}
: >"$PARTS/summary.tsv"

# --- environment: the lent image's python holds CUDA torch; missing packages come as
# wheels in .whl/ (carried: see benchmarks/README.md), installed beside it, not over it.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpucheck-site .whl/*.whl >"$PARTS/install.log" 2>&1 \
    && echo "installed: $(ls .whl | tr '\n' ' ')" >>"$PARTS/install.log"
  export PYTHONPATH=/tmp/gpucheck-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

left() { echo $((BUDGET - ($(date +%s) - START))); }

bundle() {  # summary + tarball now: a run killed later still returns these
  (cd "$PARTS" && tar czf "$OUT/parts.tar.gz.tmp" --exclude='*.tmp' . 2>/dev/null) \
    && mv "$OUT/parts.tar.gz.tmp" "$OUT/parts.tar.gz"
  {
    echo "GPU check summary ($(date -u +%FT%TZ), $(($(date +%s) - START)) s of ${BUDGET} s budget)"
    printf '%-12s %-5s %6s  %s\n' part status secs note
    while IFS=$'\t' read -r p s t n; do printf '%-12s %-5s %6s  %s\n' "$p" "$s" "$t" "$n"; done \
      <"$PARTS/summary.tsv"
  } >"$OUT/summary.txt"
  $PY - "$PARTS/summary.tsv" "$OUT/summary.json" <<'PYEOF'
import json, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
json.dump([{"part": r[0], "status": r[1], "seconds": int(r[2]), "note": r[3]} for r in rows],
          open(sys.argv[2], "w"), indent=1)
PYEOF
}

# part NAME TIMEOUT CMD...: run CMD under timeout, log to $PARTS/NAME.log; exit 0 pass,
# 77 skip, 124/137 timeout, else fail. The note is the log's skip line or last line.
part() {
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then return; fi
  local l; l=$(left)
  if [ "$l" -lt 15 ]; then
    printf '%s\tskip\t0\tno budget left\n' "$name" >>"$PARTS/summary.tsv"; bundle; return
  fi
  [ "$limit" -gt "$l" ] && limit=$l
  echo "=== $name (timeout ${limit}s) ==="
  local t0=$(date +%s) rc
  timeout -k 10 "$limit" "$@" >"$PARTS/$name.log" 2>&1; rc=$?
  local secs=$(($(date +%s) - t0)) status note
  case $rc in
    0) status=pass ;; 77) status=skip ;; 124|137) status=fail; note="timed out after ${limit}s" ;;
    *) status=fail ;;
  esac
  if [ -z "${note:-}" ]; then
    note=$(grep -m1 '^skipped: ' "$PARTS/$name.log" || grep -E '^\[FAIL\]' "$PARTS/$name.log" \
           | head -1 || true)
    [ -z "$note" ] && note=$(grep -v '^\s*$' "$PARTS/$name.log" | tail -1)
  fi
  note=$(echo "$note" | tr '\t\n' '  ' | cut -c1-160)
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "rc=$rc ${note}" >>"$PARTS/summary.tsv"
  echo "    $status ($secs s) $note"
  bundle
}

env_part() {  # what the figures ran on
  nvidia-smi || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv 2>/dev/null
  uname -a; nproc; free -g; df -h /dev/shm /tmp .
  $PY - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "nccl",
      torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("cuda available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("numpy", "safetensors", "fsspec", "xxhash", "zlib_ng", "torchtitan", "datasets", "tyro"):
    try:
        mod = __import__(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING:", type(e).__name__, e)
PYEOF
  git log -1 --format='commit %H %s' 2>/dev/null || true
}

cuda_tests() {  # the project's CUDA-only tests (skipped in CI), and their CPU twins' files
  $PY -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "skipped: no CUDA (cuda_tests; collected below, all skipped)"; SKIPPED=1; }
  $PY -m pytest -p no:cacheprovider -rs -q tests/engine/test_devstream.py -k "cuda or device_tensors" \
    tests/engine/test_staging.py "tests/interop/test_hf_load.py::test_device_tensors"
  local rc=$?
  [ $rc -eq 0 ] && [ "${SKIPPED:-0}" = 1 ] && return 77
  return $rc
}

G=benchmarks/gpu_check
export PY; export -f env_part cuda_tests  # timeout runs programs: functions go via bash -c
# Planned seconds on the H200 (timeouts are the caps; the sum stays under ~8 min).
part env         20 bash -c env_part
cp "$PARTS/env.log" "$OUT/env.txt" 2>/dev/null
part cuda_tests  75 bash -c cuda_tests
part reshard     60 $PY $G/reshard.py
part fenced      45 $PY $G/fenced.py
part bench_d2h   75 $PY $G/bench_d2h.py
part bench_async 60 $PY $G/bench_async.py
part bench_sync  50 $PY $G/bench_sync.py
part titan      150 $PY $G/titan.py
bundle
cat "$OUT/summary.txt"
