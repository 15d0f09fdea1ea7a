"""Convert the hardware test vectors of the MATLAB tensor-core toolbox (its model_validation folder) into the
compact arrays the tests read: one ``CHIP.npz`` per chip, keys ``FMT_a`` / ``FMT_b`` (codes: uint8 for FP8,
uint16 for BF16 / FP16, the float32 bits for TF32), ``FMT_c`` / ``FMT_d`` (float32 bits of the addend and of the
result the GPU returned, float32 output).

    python tests/data/tensorcore_vectors/convert.py PATH/TO/MATLAB-tensor-core/model_validation
"""
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

# L40S's vectors are Ada's, byte for byte; H100's FP8 vectors are H200's (kept there only)
CHIPS = {"A100": ("fp16", "bf16", "tf32"), "H100": ("fp16", "bf16", "tf32"),
         "H200": ("fp16", "bf16", "tf32", "E4M3", "E5M2"), "Ada": ("fp16", "bf16", "tf32", "E4M3", "E5M2"),
         "B200": ("fp16", "bf16", "tf32", "E4M3", "E5M2")}
CODES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "E4M3": ml_dtypes.float8_e4m3fn,
         "E5M2": ml_dtypes.float8_e5m2}


def hex_rows(p):
    return np.array([[int(t, 16) for t in line.split()] for line in p.read_text().split("\n") if line.strip()],
                    np.uint32)


def bin_rows(p):
    return np.array([int(line.strip(), 2) for line in p.read_text().split("\n") if line.strip()], np.uint32)


def main(src):
    src = Path(src)
    out = Path(__file__).parent
    for chip, fmts in CHIPS.items():
        arrs = {}
        for f in fmts:
            d = src / chip / f
            a, b = hex_rows(d / f"a_{chip}_{f}.txt"), hex_rows(d / f"b_{chip}_{f}.txt")
            c, r = bin_rows(d / f"c_{chip}_fp32.txt"), bin_rows(d / f"d_{chip}_fp32.txt")
            if chip in ("H100", "H200") and f in ("E4M3", "E5M2"):
                c = np.zeros_like(c)                 # wgmma: the toolbox's FP8 runs there add no C
            if f in CODES:
                ct = CODES[f]
                av, bv = a.view(np.float32), b.view(np.float32)
                ac, bc = av.astype(ct), bv.astype(ct)
                assert (ac.astype(np.float32) == av).all() and (bc.astype(np.float32) == bv).all(), (chip, f)
                u = np.uint8 if np.dtype(ct).itemsize == 1 else np.uint16
                a, b = ac.view(u), bc.view(u)
            arrs.update({f"{f.lower()}_a": a, f"{f.lower()}_b": b, f"{f.lower()}_c": c, f"{f.lower()}_d": r})
        np.savez_compressed(out / f"{chip}.npz", **arrs)
        print(chip, (out / f"{chip}.npz").stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1])
