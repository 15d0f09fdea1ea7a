"""``python -m fp4sim.validate``: check a kernel's quantized output bit for bit against fp4sim.

Exit status: 0 exact (or, for stochastic rounding without the kernel's bits, statistically consistent),
1 mismatch, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from ..arrays_io import load_array
from ..schemes import SCHEMES
from .core import compare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)}")
    ap.add_argument("--input", required=True, help="the kernel's input (.npy/.npz/.safetensors/.pt[:NAME])")
    ap.add_argument("--codes", required=True, help="the kernel's codes (FP4 packed two per byte)")
    ap.add_argument("--scales", help="the kernel's scale bytes (or float32 scales for FP8)")
    ap.add_argument("--global-amax", help="file with the kernel's NVFP4 tensor amax (one float)")
    ap.add_argument("--delayed-scaling", action="store_true",
                    help="the global amax is not the input's own |x| max (do not report it as a mismatch)")
    ap.add_argument("--scale-layout", default="linear", choices=["linear", "swizzled"])
    ap.add_argument("--flavor", help="NVFP4 flavour: te (default), paper, torchao, modelopt")
    ap.add_argument("--scale-mode", help="MX scale mode: rceil (default), floor, ceil, even")
    ap.add_argument("--block", help="block, e.g. 16x16 for NVFP4 2-D tiles or 128x128 for FP8 blockwise")
    ap.add_argument("--axis", type=int, default=-1)
    ap.add_argument("--rounding", default="rne", choices=["rne", "sr"])
    ap.add_argument("--rbits", help="the kernel's random bits (uint8 per element or uint32 words)")
    ap.add_argument("--rbits-mapping", default="te", choices=["te", "msb_first"])
    ap.add_argument("--alpha", type=float, default=1e-3, help="significance of the statistical SR check")
    ap.add_argument("--max-mismatches", type=int, default=10)
    ap.add_argument("--json", help="write the full report as JSON here")
    a = ap.parse_args(argv)
    try:
        x = load_array(a.input)
        codes = load_array(a.codes)
        scales = load_array(a.scales) if a.scales else None
        if scales is None and a.scheme != "bf16":
            raise ValueError(f"--scales is required for scheme {a.scheme}")
        g = None
        if a.global_amax:
            ga = np.asarray(load_array(a.global_amax), dtype=np.float32).reshape(-1)
            if ga.size != 1:
                raise ValueError(f"--global-amax must hold one number, found {ga.size}")
            g = ga[0]
        rbits = load_array(a.rbits) if a.rbits else None
        block = None
        if a.block:
            try:
                block = tuple(int(v) for v in a.block.lower().split("x"))
            except ValueError:
                raise ValueError(f"--block {a.block!r}: write it as ROWSxCOLS, e.g. 16x16") from None
        rep = compare(x, codes, scales, a.scheme, axis=a.axis, flavor=a.flavor, scale_mode=a.scale_mode,
                      block=block, global_amax=g, scale_layout=a.scale_layout, rounding=a.rounding, rbits=rbits,
                      rbits_mapping=a.rbits_mapping, expect_tensor_amax=not a.delayed_scaling,
                      max_mismatches=a.max_mismatches, alpha=a.alpha)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"fp4sim.validate: bad input: {e}", file=sys.stderr)
        return 2
    print(rep.summary())
    if a.json:
        with open(a.json, "w") as f:
            f.write(rep.to_json())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
