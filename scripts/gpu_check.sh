#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build syncbn_lab._C with its CUDA kernels (for this GPU's
# architecture), run the CUDA tests and the GPU benchmark, and write the results as JSON to
# $OUT (or ./gpu_results): gpu_check.json (summary), bench_gpu.json, pytest.xml and logs.
# Every step has a time limit; the whole check stays under 6 minutes. Last, where NVIDIA's
# compute-sanitizer is installed, the CUDA tests run again under its memcheck tool (out-of-bounds
# and misaligned accesses; sanitizer.log), leaving out the big-tensor tests, torch.compile
# (Triton under the sanitizer is slow), the profiler's launch count and the stream test (a second's
# sleep kernel, and the sanitizer can serialise launches across streams).
#
#   bash scripts/gpu_check.sh            # PYTHON=... picks the interpreter (default: .venv, python3)
#   GPU_CHECK_REUSE=1 bash scripts/gpu_check.sh   # keep an existing CUDA build of syncbn_lab._C
#
# The built module is copied to the results folder, so a rerun on a fresh machine can bring it
# back to src/syncbn_lab/ and skip the build with GPU_CHECK_REUSE=1.
#
# Needs torch (a CUDA build), setuptools, ninja and pytest; not the project's other
# dependencies (the package runs from src/ without being installed).
#
# tests/bench/test_gpu_check.py runs every Python command of this script on the CPU (the
# benchmark as --dry-run, the pytest calls as --setup-plan, the build excepted), so a change
# that breaks one fails the suite instead of the next GPU session.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-gpu_results}"
mkdir -p "$OUT_DIR"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PYTHON sees no CUDA GPU (torch.cuda.is_available() is False)" >&2
  exit 2
fi
arch=$("$PYTHON" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" SYNCBN_LAB_CUDA=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

has_cuda_kernels() {
  "$PYTHON" -c "import sys; from syncbn_lab.nn import _ext; sys.exit(0 if _ext.has_cuda_kernels() else 1)"
}
b0=$(date +%s)
if [ "${GPU_CHECK_REUSE:-0}" = 1 ] && has_cuda_kernels 2>/dev/null; then
  echo "== build skipped (GPU_CHECK_REUSE=1 and src/syncbn_lab holds a CUDA build)"
  build_rc=0
else
  echo "== build (archs $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
  rm -f src/syncbn_lab/_C*.so
  timeout 180 "$PYTHON" setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1
  build_rc=$?
fi
build_s=$(($(date +%s) - b0))
if has_cuda_kernels; then
  build_ok=1
  echo "   built in ${build_s} s"
  cp src/syncbn_lab/_C*.so "$OUT_DIR/" 2>/dev/null
else
  build_ok=0
  echo "gpu_check: the CUDA build failed (rc $build_rc); end of $OUT_DIR/build.log:" >&2
  grep -E "error|FAILED" "$OUT_DIR/build.log" | head -20 >&2
fi

test_rc=-1
bench_rc=-1
sanitizer_rc=-2  # -2: not run (no build); -1: compute-sanitizer not installed
if [ "$build_ok" = 1 ]; then
  echo "== tests (CUDA and CPU kernels)"
  # --noconftest: tests/conftest.py composes Hydra configs, which these tests do not need.
  timeout 150 "$PYTHON" -m pytest -q --noconftest -p no:cacheprovider tests/ops \
    -m "not slow or cuda" --junitxml="$OUT_DIR/pytest.xml" >"$OUT_DIR/pytest.log" 2>&1
  test_rc=$?
  tail -3 "$OUT_DIR/pytest.log"

  echo "== benchmark"
  timeout 70 "$PYTHON" scripts/bench_kernels.py --rounds 10 --json "$OUT_DIR/bench_gpu.json" \
    2>&1 | tee "$OUT_DIR/bench.log"
  bench_rc=${PIPESTATUS[0]}

  sanitizer_rc=-1
  if command -v compute-sanitizer >/dev/null; then
    echo "== compute-sanitizer memcheck on the CUDA tests"
    timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
      "$PYTHON" -m pytest -q --noconftest -p no:cacheprovider tests/ops/test_cuda_ops.py \
      -k "not 64bit and not large_offset and not grid_dimension and not compiles \
          and not launches and not current_stream" \
      >"$OUT_DIR/sanitizer.log" 2>&1
    sanitizer_rc=$?
    grep -E "ERROR SUMMARY|passed|failed" "$OUT_DIR/sanitizer.log" | tail -3
  fi
fi

total_s=$(($(date +%s) - t0))
"$PYTHON" - "$OUT_DIR" "$build_ok" "$build_s" "$test_rc" "$bench_rc" "$sanitizer_rc" "$total_s" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, build_ok, build_s, test_rc, bench_rc, sanitizer_rc, total_s = sys.argv[1:]
out = Path(out)
tests = None
if (out / "pytest.xml").is_file():
    suite = ET.parse(out / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tests = counts
bench = None
if (out / "bench_gpu.json").is_file():
    bench = json.loads((out / "bench_gpu.json").read_text())
summary = {
    "device": torch.cuda.get_device_name(),
    "capability": ".".join(map(str, torch.cuda.get_device_capability())),
    "torch": torch.__version__,
    "build_ok": build_ok == "1",
    "build_seconds": int(build_s),
    "tests_rc": int(test_rc),
    "tests": tests,
    "bench_rc": int(bench_rc),
    "bench": bench,
    "sanitizer_rc": int(sanitizer_rc),
    "total_seconds": int(total_s),
}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(f"== wrote {out / 'gpu_check.json'} ({total_s} s)")
EOF

[ "$build_ok" = 1 ] && [ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
