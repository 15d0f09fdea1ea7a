#!/usr/bin/env bash
# One-shot GPU check for a machine with an NVIDIA GPU: install the gpu extra if CuPy is missing, name the
# tensor-core model the device's FP8 and 16-bit GEMMs match (benchmarks/tensorcore_check.py), run the GPU test
# suite (CuPy results == Numba results, bit for bit; a converted layer on a side stream), a quantize call split
# into its kernels (gpu_profile.py), the kernel benchmark
# (bench_gpu.py: every kernel at 8192^2 and the GPT-2-small training shapes, as a share of the copy bandwidth) and
# the training benchmark (bench_training.py --model gpt2-124m: the emulated step against BF16 autocast and float32;
# the exact GEMM rules on a smaller batch) and the analysis of a 1e9-element BF16 checkpoint on the device
# (bench_analyze.py --device cuda), and write everything (logs and JSON) to OUTDIR, with report.md: the tables
# and each target's verdict (gpu_report.py).
# Usage: benchmarks/gpu_check.sh [OUTDIR]   (each step has a time limit, together 8 minutes; about 5
# on an H200, much of it NVRTC compilation)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
"$py" -c "import cupy" 2>/dev/null || "$py" -m pip install -q ".[gpu]"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import cupy, numba, numpy, torch; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)" | tee "$out/versions.txt"
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log, record the exit status and seconds
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "$name: exit status $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/steps.txt"
    return "$rc"
}
step tensorcore_check 45 "$py" benchmarks/tensorcore_check.py --out "$out/tensorcore"
step gpu_profile 20 "$py" benchmarks/gpu_profile.py
step gpu_tests 170 "$py" -m pytest -q -rfE --durations=15 -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    tests/test_training.py tests/test_gpu_streams.py tests/test_analyze_device.py
tests_rc=$?
step bench_gpu 60 "$py" benchmarks/bench_gpu.py --json "$out/bench_gpu.json"
step bench_training 70 "$py" benchmarks/bench_training.py --model gpt2-124m --device cuda --json "$out/bench_training.json"
step bench_training_exact 35 "$py" benchmarks/bench_training.py --model gpt2-124m --device cuda --batch 1 --seq 256 \
    --repeat 1 --presets nvfp4_paper --exact-rules --json "$out/bench_training_exact.json"
step bench_analyze 80 "$py" benchmarks/bench_analyze.py --checkpoint-elems 1e9 --device cuda --json "$out/bench_analyze.json"
echo "gpu tests exit status: $tests_rc" | tee -a "$out/steps.txt"
"$py" benchmarks/gpu_report.py "$out" --json "$out/verdicts.json" > "$out/report.md"   # the tables, with verdicts
exit "$tests_rc"
