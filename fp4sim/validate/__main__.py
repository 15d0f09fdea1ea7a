"""``python -m fp4sim.validate``: check a kernel's quantized output bit for bit against fp4sim.

Exit status: 0 exact (or, for stochastic rounding without the kernel's bits, statistically consistent),
1 mismatch, 2 bad input.

``python -m fp4sim.validate gemm ...`` names the accumulation model that reproduces a GEMM kernel's output,
``python -m fp4sim.validate gemm-witnesses --out DIR`` writes operand sets that tell the models apart, and
``python -m fp4sim.validate checkpoint DIR`` checks an NVFP4 checkpoint (ModelOpt or compressed-tensors) (each
with its own --help).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ..arrays_io import check_writable, input_paths, load_array, number_or_array
from .._tool import say
from ..schemes import SCHEMES, get_scheme
from .core import CLI_NAMES, compare


def checkpoint_main(argv) -> int:
    """``python -m fp4sim.validate checkpoint DIR [--reference REF] [--json F]``: exit 0 consistent (and, with a
    reference, byte for byte equal), 1 faults found, 2 bad input."""
    from .checkpoint import __doc__ as doc
    from .checkpoint import check_checkpoint
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate checkpoint", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the checkpoint's folder (config files and .safetensors, sharded or not), or a .gguf file")
    ap.add_argument("--reference", help="the high-precision weights it was made from (a folder or file)")
    ap.add_argument("--json", help="write the report as JSON here")
    a = ap.parse_args(argv)
    try:
        if a.json:
            check_writable(a.json, "--json", inputs=input_paths(a, outputs=("json",)))
        rep = check_checkpoint(a.dir, a.reference)
    except (ValueError, OSError) as e:
        print(f"fp4sim.validate checkpoint: bad input: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    # the JSON first, then the report: a reader that closes the pipe early (| head) loses no result
    if a.json and not _write_json(a.json, rep.to_json() + "\n", "fp4sim.validate checkpoint"):
        return 2
    say(rep.summary())
    return 0 if rep.ok else 1


def _write_json(path, text: str, prog: str) -> bool:
    try:
        Path(path).write_text(text)
        return True
    except OSError as e:
        print(f"{prog}: bad input: --json {path}: {e.strerror or e}", file=sys.stderr)
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("gemm", "gemm-witnesses"):
        from .gemm_cli import gemm_main, witnesses_main
        return (gemm_main if argv[0] == "gemm" else witnesses_main)(argv[1:])
    if argv and argv[0] == "checkpoint":
        return checkpoint_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)}")
    ap.add_argument("--input", required=True, help="the kernel's input (.npy/.npz/.safetensors/.pt[:NAME])")
    ap.add_argument("--codes", required=True, help="the kernel's codes (FP4 packed two per byte; FP6 one per byte or "
                                                    "packed four to three bytes; INT8 as two's complement bytes)")
    ap.add_argument("--scales", help="the kernel's scale bytes (or float32 scales for FP8)")
    ap.add_argument("--global-amax", help="the kernel's NVFP4 tensor amax: a file holding one float, or a number")
    ap.add_argument("--tensor-scale",
                    help="instead of --global-amax: the per-tensor decode scale as torchao (per_tensor_scale) and "
                         "ModelOpt store it, amax / 2688 (a file holding one float, or a number)")
    ap.add_argument("--delayed-scaling", action="store_true",
                    help="the global amax is not the input's own |x| max (do not report it as a mismatch)")
    ap.add_argument("--scale-layout", default="linear", choices=["linear", "swizzled"])
    ap.add_argument("--flavor", help="NVFP4 flavour: te (default), paper, torchao, modelopt")
    ap.add_argument("--scale-mode", help="MX scale mode: rceil (default), floor, ceil, even")
    ap.add_argument("--row-scaled", action="store_true",
                    help="NVFP4 with one FP32 tensor scale per row (TE's row_scaled_nvfp4; --global-amax then "
                         "holds one amax per row)")
    ap.add_argument("--four-over-six", choices=["mae", "mse"],
                    help="TE's 4over6 NVFP4 block scales with this error rule (te flavour)")
    ap.add_argument("--four-over-six-fast-math", action="store_true", help="4over6 error in the FP16 product domain")
    ap.add_argument("--four-over-six-e4m3-max", type=int, default=448, choices=[448, 256],
                    help="the E4M3 maximum of 4over6's tensor scale")
    ap.add_argument("--no-tensor-scale", action="store_true",
                    help="torchao's NVFP4 without a per-tensor scale (implies --flavor torchao)")
    ap.add_argument("--block", help="block, e.g. 16x16 for NVFP4 2-D tiles or 128x128 for FP8 blockwise")
    ap.add_argument("--axis", type=int, default=-1)
    ap.add_argument("--rounding", default="rne", choices=["rne", "sr"])
    ap.add_argument("--rbits", help="the kernel's random bits (uint8 per element or uint32 words)")
    ap.add_argument("--rbits-mapping", default="te", choices=["te", "msb_first", "midpoint"],
                    help="how the random bits round: te (TE's byte order, truncating rule), msb_first (bytes 3-k of "
                         "each word), midpoint (TE's order, up iff delta + (2r + 1) / 512 >= 1)")
    ap.add_argument("--sr-bits", type=int, default=8, help="random bits per element of the kernel's SR (1..8)")
    ap.add_argument("--alpha", type=float, default=1e-3, help="significance of the statistical SR check")
    ap.add_argument("--max-mismatches", type=int, default=10)
    ap.add_argument("--json", help="write the full report as JSON here")
    a = ap.parse_args(argv)
    try:
        _check_options(a)
        x = load_array(a.input)
        codes = load_array(a.codes)
        scales = load_array(a.scales) if a.scales else None
        if scales is None and a.scheme != "bf16":
            raise ValueError(f"--scales is required for scheme {a.scheme}")
        g = number_or_array(a.global_amax, a.row_scaled, "--global-amax") if a.global_amax else None
        if g is not None and np.isnan(np.asarray(g)).any():
            raise ValueError(f"--global-amax {a.global_amax}: give the tensor's |x| max the kernel used, a number "
                             "(not NaN)")
        ts = number_or_array(a.tensor_scale, False, "--tensor-scale") if a.tensor_scale else None
        rbits = load_array(a.rbits) if a.rbits else None
        block = None
        if a.block:
            try:
                block = tuple(int(v) for v in a.block.lower().split("x"))
            except ValueError:
                raise ValueError(f"--block {a.block!r}: write it as ROWSxCOLS, e.g. 16x16") from None
        scheme = a.scheme
        if a.row_scaled or a.no_tensor_scale or a.four_over_six:
            scheme = get_scheme(a.scheme, flavor="torchao" if a.no_tensor_scale else a.flavor,
                                row_scaled=a.row_scaled or None, per_tensor_scale=False if a.no_tensor_scale else None,
                                four_over_six=a.four_over_six, four_over_six_fast_math=a.four_over_six_fast_math or None,
                                four_over_six_e4m3_max=a.four_over_six_e4m3_max if a.four_over_six else None)
            a.flavor = None
        rep = compare(x, codes, scales, scheme, axis=a.axis, flavor=a.flavor, scale_mode=a.scale_mode,
                      block=block, global_amax=g, scale_layout=a.scale_layout, rounding=a.rounding, rbits=rbits,
                      rbits_mapping=a.rbits_mapping, sr_bits=a.sr_bits, expect_tensor_amax=not a.delayed_scaling,
                      max_mismatches=a.max_mismatches, alpha=a.alpha, tensor_scale=ts, _names=CLI_NAMES)
    except (ValueError, TypeError, OSError) as e:
        print(f"fp4sim.validate: bad input: {_one_line(e)}", file=sys.stderr)
        return 2
    if a.json and not _write_json(a.json, rep.to_json(), "fp4sim.validate"):
        return 2
    say(rep.summary())
    return 0 if rep.ok else 1


def _one_line(e) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _check_options(a):
    """Every option checked before any file is read."""
    if not 0 < a.alpha < 1:
        raise ValueError(f"--alpha {a.alpha}: the significance must lie strictly between 0 and 1 (e.g. 1e-3)")
    if a.max_mismatches < 0:
        raise ValueError(f"--max-mismatches {a.max_mismatches}: give a count >= 0")
    if not 1 <= a.sr_bits <= 8:
        raise ValueError(f"--sr-bits {a.sr_bits}: give 1..8")
    if a.rbits and a.rounding != "sr":
        raise ValueError("--rbits gives the kernel's stochastic-rounding bits; it needs --rounding sr")
    if a.scheme not in SCHEMES:
        raise ValueError(f"--scheme {a.scheme!r}: use one of {', '.join(SCHEMES)}")
    for opt, path in (("--input", a.input), ("--codes", a.codes), ("--scales", a.scales), ("--rbits", a.rbits)):
        if path and not Path(path).exists() and not Path(path.rpartition(":")[0] or path).exists():
            raise ValueError(f"{opt} {path}: no such file")
    if a.json:
        check_writable(a.json, "--json", inputs=input_paths(a, outputs=("json",)))


if __name__ == "__main__":
    from .._tool import run_tool
    raise SystemExit(run_tool(main, "fp4sim.validate"))

