"""Shared fixtures: float32 bit-pattern sweeps and the CUDA host-conversion oracle."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ORACLE_SRC = Path(__file__).parent / "oracles" / "cuda_host_convert.cpp"


def oracle_missing(reason: str):
    """Skip a test whose oracle is missing, or fail it where FP4SIM_REQUIRE_ORACLES=1 (CI): there a skipped
    cross-check would pass for a check that never ran."""
    if os.environ.get("FP4SIM_REQUIRE_ORACLES") == "1":
        pytest.fail(f"oracle required (FP4SIM_REQUIRE_ORACLES=1) but missing: {reason}")
    pytest.skip(reason)


def float32_sweep(per_binade: int = 1960, seed: int = 0) -> np.ndarray:
    """>= 10^6 float32 values: every exponent field (0..255) x both signs x edge and random mantissas,
    so subnormals, +-0, +-Inf and NaNs (several payloads) are all present."""
    rng = np.random.default_rng(seed)
    edge = np.array([0, 1, 2, 3, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF, 0x200000, 0x600000,
                     0x100000, 0x080000, 0x040000, 0x0C0000, 0x140000, 0x1C0000], dtype=np.uint32)
    mant = np.concatenate([edge, rng.integers(0, 1 << 23, per_binade - edge.size, dtype=np.uint32)])
    exps = np.arange(256, dtype=np.uint32)
    bits = (exps[:, None] << 23) | mant[None, :]
    bits = np.concatenate([bits.ravel(), bits.ravel() | np.uint32(0x80000000)])
    return bits.view(np.float32)


@pytest.fixture(scope="session")
def sweep() -> np.ndarray:
    x = float32_sweep()
    assert x.size >= 10**6
    return x


def cuda_include_dir() -> str | None:
    """Directory holding cuda_fp4.h, from nvcc (or CUDA_HOME / the usual install path)."""
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "-E", "-x", "cu", "-", "-v"], input="", capture_output=True, text=True,
                                 timeout=60).stderr
            for line in out.splitlines():
                if "INCLUDES=" in line:
                    for tok in line.split('"'):
                        if tok.startswith("-I"):
                            cands.append(tok[2:])
        except (OSError, subprocess.SubprocessError):
            pass
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            cands += [os.path.join(home, "include"), os.path.join(home, "targets/x86_64-linux/include")]
    for c in cands:
        if os.path.exists(os.path.join(c, "cuda_fp4.h")):
            return c
    return None


@pytest.fixture(scope="session")
def cuda_convert(tmp_path_factory):
    """A function x(float32) -> dict of code planes computed by CUDA's own host conversions."""
    inc = cuda_include_dir()
    if inc is None:
        oracle_missing("no CUDA toolkit headers (cuda_fp4.h) found: install the CUDA toolkit or set CUDA_HOME")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        oracle_missing("no host C++ compiler (g++) found")
    d = tmp_path_factory.mktemp("cuda_oracle")
    exe = d / "cuda_host_convert"
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{inc}", str(ORACLE_SRC), "-o", str(exe)], check=True)

    names8 = ["e2m1_rn", "e2m1_rz", "e4m3_sat", "e4m3_nosat", "e5m2_sat", "e5m2_nosat", "e8m0_rz_sat",
              "e8m0_rp_sat", "e8m0_rz_nosat", "e8m0_rp_nosat", "e2m3_rn", "e2m3_rz", "e3m2_rn", "e3m2_rz"]
    names16 = ["bf16_rn", "bf16_rz", "bf16_ru", "bf16_rd"]

    def run(x: np.ndarray) -> dict[str, np.ndarray]:
        x = np.ascontiguousarray(x, dtype=np.float32).ravel()
        n = x.size
        (d / "in.f32").write_bytes(x.tobytes())
        subprocess.run([str(exe), str(d / "in.f32"), str(d / "out.bin")], check=True)
        raw = (d / "out.bin").read_bytes()
        k = len(names8)
        p8 = np.frombuffer(raw[: k * n], dtype=np.uint8).reshape(k, n)
        p16 = np.frombuffer(raw[k * n:], dtype=np.uint16).reshape(4, n)
        return {**dict(zip(names8, p8)), **dict(zip(names16, p16))}

    return run


@pytest.fixture(scope="session")
def host_lib(tmp_path_factory):
    """fp4sim/gpu/kernels.cu compiled for the host through tests/oracles/cuda_host_shim.h (a shared library for
    fp4sim.gpu.backend.HostBackend)."""
    from fp4sim.gpu.backend import SOURCE, write_ids_header
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        oracle_missing("no host C++ compiler (g++) to build the kernels for the host")
    oracles = Path(__file__).parent / "oracles"
    out = tmp_path_factory.mktemp("gpu_host") / "libfp4sim_kernels_host.so"
    ids = write_ids_header(out.parent)
    subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-include", str(ids),
                    f"-I{oracles}", f"-I{SOURCE.parent}", str(oracles / "gpu_host_driver.cpp"), "-o", str(out)],
                   check=True)
    return out
