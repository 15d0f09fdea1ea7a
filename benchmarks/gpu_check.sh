#!/usr/bin/env bash
# One-shot GPU check for a machine with an NVIDIA GPU: install the gpu extra if CuPy is missing, name the
# tensor-core model the device's FP8 and 16-bit GEMMs match (benchmarks/tensorcore_check.py), run the GPU test
# suite (CuPy results == Numba results, bit for bit) and the GPU benchmark, and write everything to OUTDIR.
# Usage: benchmarks/gpu_check.sh [OUTDIR]   (about 3 minutes on an H200, most of it Numba/NVRTC compilation;
# each step has a time limit, together under 10 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
"$py" -c "import cupy" 2>/dev/null || "$py" -m pip install -q ".[gpu]"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)" | tee "$out/versions.txt"
timeout 150 "$py" benchmarks/tensorcore_check.py --out "$out/tensorcore" 2>&1 | tee "$out/tensorcore_check.log"
timeout 330 "$py" -m pytest -q -rfE --durations=15 -m gpu -p no:cacheprovider tests/test_gpu_kernels.py tests/test_training.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 100 "$py" benchmarks/bench_gpu.py --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log"
echo "gpu tests exit status: $tests_rc" | tee -a "$out/gpu_tests.log"
exit "$tests_rc"
