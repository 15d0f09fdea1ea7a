"""The command lines ``python -m fp4sim.validate gemm`` and ``python -m fp4sim.validate gemm-witnesses``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arrays_io import check_writable, load_array, number_or_array

GEMM_DOC = """python -m fp4sim.validate gemm: which accumulation model reproduces a GEMM kernel's output, y = A . B^T.

The operands, either as the kernel's quantized inputs (NVFP4: --a-codes, --a-scales, --a-amax and the same for
B) or as high-precision inputs that fp4sim quantizes (--a, --b, --scheme); --out the kernel's output (M, N),
float32 or bfloat16. Or --witnesses DIR --outputs DIR: every witness written by gemm-witnesses against the
device's outputs, and the models consistent with all of them.

Exit status: 0 a model reproduces every output element bit for bit (with --expect: that model does), 1 none
does, 2 bad input.
"""

WITNESS_DOC = """python -m fp4sim.validate gemm-witnesses --out DIR: write NVFP4 GEMM operand sets whose outputs tell the
accumulation models apart (K-block permutations, same-sign partials, group-width probes, the 1/1024 grid,
bfloat16-midpoint cells), each with every model's expected output; run them on a device and check the outputs
with python -m fp4sim.validate gemm --witnesses DIR --outputs OUTDIR.
"""


def _fail(msg: str) -> int:
    print(f"fp4sim.validate gemm: bad input: {' '.join(str(msg).split())}", file=sys.stderr)
    return 2


def _block(spec, flag):
    if spec is None:
        return None
    try:
        return tuple(int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: write it as ROWSxCOLS, e.g. 16x16") from None


def gemm_main(argv) -> int:
    from .gemm import CANDIDATES, check_witnesses, compare_gemm, gemm_operand, load_output
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate gemm", description=GEMM_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        S = side.upper()
        ap.add_argument(f"--{side}-codes", help=f"{S}'s E2M1 codes, (rows, K/2) bytes, element 2i in the low nibble")
        ap.add_argument(f"--{side}-scales", help=f"{S}'s E4M3 block-scale bytes, linear (rows, K/16) (16x16 tiles: "
                                                 "one per tile) or swizzled with --scale-layout swizzled")
        ap.add_argument(f"--{side}-amax", help=f"{S}'s float32 tensor amax: a file (one value, or one per row) or a "
                                               "number")
        ap.add_argument(f"--{side}-block", help=f"{S}'s NVFP4 block, 1x16 (default) or 16x16")
        ap.add_argument(f"--{side}", help=f"instead of the codes: {S}'s high-precision input (rows, K), which fp4sim "
                                          "quantizes along K with --scheme")
    ap.add_argument("--k", type=int, help="the dot-product length K (default: twice the codes' width)")
    ap.add_argument("--scheme", default="nvfp4", help="with --a / --b: the scheme both are quantized with")
    ap.add_argument("--scale-layout", default="linear", choices=["linear", "swizzled"])
    ap.add_argument("--out", help="the kernel's output (M, N)")
    ap.add_argument("--out-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: the output file holds bfloat16 bits as uint16 (an ml_dtypes bfloat16 .npy is "
                         "read as bfloat16 without it)")
    ap.add_argument("--models", help=f"comma-separated candidates (default: all of {', '.join(CANDIDATES)})")
    ap.add_argument("--expect", help="exit 0 only if this model reproduces the output")
    ap.add_argument("--witnesses", help="a folder written by gemm-witnesses (with --outputs)")
    ap.add_argument("--outputs", help="with --witnesses: the device's outputs, one NAME.npy per witness")
    ap.add_argument("--max-mismatches", type=int, default=10)
    ap.add_argument("--json", help="write the report as JSON here")
    a = ap.parse_args(argv)
    try:
        if a.json:
            check_writable(a.json, "--json")
        if a.expect and a.expect not in CANDIDATES:
            raise ValueError(f"--expect {a.expect!r}: one of {', '.join(CANDIDATES)}")
        if a.witnesses or a.outputs:
            if not (a.witnesses and a.outputs):
                raise ValueError("--witnesses and --outputs go together (the witness folder and the device's outputs)")
            res = check_witnesses(a.witnesses, a.outputs, a.out_dtype)
            ok = (a.expect in res["consistent"]) if a.expect else bool(res["consistent"])
            for n, rep in res["reports"].items():
                if len(rep.matches) == len(rep.match_fraction):
                    got = f"consistent with all {len(rep.matches)} models (this witness does not separate them)"
                elif len(rep.matches) > len(rep.match_fraction) / 2:
                    got = "consistent with every model but " + ", ".join(m for m in rep.match_fraction
                                                                       if m not in rep.matches)
                elif rep.matches:
                    got = f"consistent with {', '.join(rep.matches)}"
                else:
                    got = (f"NO MODEL MATCHES (closest: {rep.closest}, {100 * rep.match_fraction[rep.closest]:.2f}% "
                           "identical)" + "".join(f"; {f}" for f in rep.faults))
                print(f"{n}: {got}")
            print("consistent with every witness: " + (", ".join(res["consistent"]) or "no model"))
            if a.json:
                Path(a.json).write_text(json.dumps({"consistent": res["consistent"], "reports": {
                    n: r.to_dict() for n, r in res["reports"].items()}}, indent=1, default=float) + "\n")
            return 0 if ok else 1
        if not a.out:
            raise ValueError("--out (the kernel's output) is required, or --witnesses with --outputs")
        models = [m.strip() for m in a.models.split(",")] if a.models else None
        if a.a or a.b:
            if not (a.a and a.b) or a.a_codes or a.b_codes:
                raise ValueError("give both --a and --b (high-precision inputs), or the codes, scales and amax of both")
            extra = [f for f, v in (("--k", a.k), ("--a-scales", a.a_scales), ("--b-scales", a.b_scales),
                                    ("--a-amax", a.a_amax), ("--b-amax", a.b_amax)) if v is not None]
            if extra or a.scale_layout != "linear":
                raise ValueError(f"{', '.join(extra) or '--scale-layout'} describe(s) kernel codes; with --a / --b "
                                 "fp4sim quantizes the inputs itself (K is their last axis)")
            from ..quantize import quantize
            qa = quantize(load_array(a.a), a.scheme, block=_block(a.a_block, "--a-block"))
            qb = quantize(load_array(a.b), a.scheme, block=_block(a.b_block, "--b-block"))
        else:
            need = [f"--{s}-{w}" for s in ("a", "b") for w in ("codes", "scales", "amax")
                    if getattr(a, f"{s}_{w}") is None]
            if need:
                raise ValueError(f"missing {', '.join(need)} (or give --a and --b, high-precision inputs)")
            qa = gemm_operand(load_array(a.a_codes), load_array(a.a_scales),
                              number_or_array(a.a_amax, True, "--a-amax"), a.k,
                              block=_block(a.a_block, "--a-block") or (1, 16), scale_layout=a.scale_layout, name="A")
            qb = gemm_operand(load_array(a.b_codes), load_array(a.b_scales),
                              number_or_array(a.b_amax, True, "--b-amax"), a.k,
                              block=_block(a.b_block, "--b-block") or (1, 16), scale_layout=a.scale_layout, name="B")
        if qa.K != qb.K:
            raise ValueError(f"A has K={qa.K} and B K={qb.K}")
        rep = compare_gemm(qa, qb, load_output(a.out, a.out_dtype), models=models, max_mismatches=a.max_mismatches)
    except (ValueError, TypeError, OSError) as e:
        return _fail(e)
    print(rep.summary())
    if a.json:
        Path(a.json).write_text(rep.to_json() + "\n")
    return 0 if (a.expect in rep.matches if a.expect else rep.ok) else 1


def witnesses_main(argv) -> int:
    from .gemm import write_witnesses
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate gemm-witnesses", description=WITNESS_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder to write (created; an existing one must be empty)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        man = write_witnesses(a.out, a.seed)
    except ValueError as e:
        return _fail(f"--out {e}")
    except OSError as e:
        return _fail(f"--out {a.out}: {e.strerror or e}")
    worst = min(man["separating_cells"].values())
    print(f"wrote {len(man['witnesses'])} witnesses to {a.out} ({', '.join(man['witnesses'])}); every pair of "
          f"the {len(man['models'])} models differs in at least {worst} cells "
          f"(float32; bfloat16: {min(man['separating_cells_bf16'].values())})")
    return 0
