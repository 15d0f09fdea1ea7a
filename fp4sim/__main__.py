"""``python -m fp4sim``: print the element-format table and round a test tensor through every format and
block-scaled scheme."""
from __future__ import annotations

import argparse

import numpy as np

import fp4sim as fs
from fp4sim._tool import say
from fp4sim.formats import spec_markdown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4sim", description=__doc__)
    p.add_argument("--spec", action="store_true", help="print only the Markdown format table (the table of docs/formats.md)")
    p.add_argument("--recipes", action="store_true", help="print only the Markdown table of the training presets")
    args = p.parse_args(argv)
    if args.spec:
        say(spec_markdown().rstrip("\n"))
        return 0
    if args.recipes:
        from fp4sim.training import presets_markdown
        say(presets_markdown().rstrip("\n"))
        return 0
    say(f"fp4sim {fs.__version__}: element formats\n")
    say(spec_markdown())
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((256, 256)) * np.exp(rng.standard_normal((256, 1)))).astype(np.float32)
    say("Round trip of a 256x256 heavy-tailed tensor (rows scaled by exp(N(0,1))), no block scaling:")
    say(f"{'format':9} {'rounding':8} {'SQNR dB':>9} {'zero %':>8} {'saturated %':>12}")
    for fmt in (fs.E2M1, fs.E2M3, fs.E3M2, fs.E4M3, fs.E5M2, fs.E4M3FNUZ, fs.BINARY8P3, fs.BF16):
        for rounding, kw in (("rne", {}), ("sr", {"seed": 0})):
            codes = fs.encode(x, fmt, rounding=rounding, **kw)
            y = fs.decode(codes, fmt)
            err = float(np.mean((y - x).astype(np.float64) ** 2))
            sqnr = 10 * np.log10(float(np.mean(x.astype(np.float64) ** 2)) / err) if err else np.inf
            zero = 100 * np.mean((y == 0) & (x != 0))
            sat = 100 * np.mean(np.abs(x) > fmt.max)
            say(f"{fmt.name:9} {rounding:8} {sqnr:9.2f} {zero:8.2f} {sat:12.2f}")
    say("\nThe same tensor through the block-scaled schemes (quantize -> dequantize):")
    say(f"{'scheme':14} {'SQNR dB':>9} {'zero %':>8}")
    for scheme in ("nvfp4", "nvfp4_2d", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxint8", "fp8_e4m3",
                   "fp8_e4m3fnuz", "fp8_blockwise", "bf16"):
        y = fs.fake_quantize(x, scheme)
        err = float(np.mean((y - x).astype(np.float64) ** 2))
        sqnr = 10 * np.log10(float(np.mean(x.astype(np.float64) ** 2)) / err) if err else np.inf
        say(f"{scheme:14} {sqnr:9.2f} {100 * np.mean((y == 0) & (x != 0)):8.2f}")
    return 0


if __name__ == "__main__":
    from ._tool import run_tool
    raise SystemExit(run_tool(main, "fp4sim"))
