"""The command lines ``python -m fp4sim.validate gemm`` and ``python -m fp4sim.validate gemm-witnesses``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arrays_io import check_writable, input_paths, load_array, number_or_array
from .._tool import say

GEMM_DOC = """python -m fp4sim.validate gemm: which accumulation model reproduces a GEMM kernel's output, y = A . B^T.

The operands, either as the kernel's quantized inputs (NVFP4: --a-codes, --a-scales, --a-amax and the same for
B; FP8 with per-tensor scales, as torch._scaled_mm takes them: --a-fp8, --a-format, --a-scale and the same for
B, and the tensor-core models of fp4sim.tensorcore as candidates) or as high-precision inputs that fp4sim
quantizes (--a, --b, --scheme); --out the kernel's output (M, N), float32 or bfloat16 (FP8 GEMMs also float16,
float8_e4m3fn, float8_e5m2). Or --witnesses DIR --outputs DIR: every witness written by gemm-witnesses against the
device's outputs, and the models consistent with all of them.

Exit status: 0 a model reproduces every output element bit for bit (with --expect: that model does), 1 none
does, 2 bad input.
"""

WITNESS_DOC = """python -m fp4sim.validate gemm-witnesses --out DIR: write NVFP4 GEMM operand sets whose outputs tell the
accumulation models apart (K-block permutations, same-sign partials, group-width probes, the 1/1024 grid,
bfloat16-midpoint cells), each with every model's expected output; run them on a device and check the outputs
with python -m fp4sim.validate gemm --witnesses DIR --outputs OUTDIR. --format fp8: torch._scaled_mm's FP8 GEMMs
against the tensor-core models (hopper, ada, b200, b200_mma, fast and slow accumulation); --format bf16: a bfloat16
matmul against the 16-bit models (hopper, ampere, exact, float32_seq).
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
        ap.add_argument(f"--{side}-fp8", help=f"an FP8 GEMM: {S}'s FP8 bytes, (rows, K) uint8 (B as its N rows of K, "
                                              "i.e. w, not w.t()), with --{side}-format")
        ap.add_argument(f"--{side}-format", choices=["e4m3", "e5m2"], help=f"with --{side}-fp8: the bytes' format")
        ap.add_argument(f"--{side}-scale", help=f"with --{side}-fp8: {S}'s float32 per-tensor decode scale (a number "
                                                "or a one-element file)")
    ap.add_argument("--k", type=int, help="the dot-product length K (default: twice the codes' width)")
    ap.add_argument("--scheme", default="nvfp4", help="with --a / --b: the scheme both are quantized with")
    ap.add_argument("--scale-layout", default="linear", choices=["linear", "swizzled"])
    ap.add_argument("--out", help="the kernel's output (M, N)")
    ap.add_argument("--out-dtype", default="float32",
                    choices=["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"],
                    help="bfloat16: the output file holds bfloat16 bits as uint16 (an ml_dtypes bfloat16 .npy is "
                         "read as bfloat16 without it); float16 and the FP8 dtypes: FP8 GEMMs only")
    ap.add_argument("--split-k", help="FP8: the split the kernel used, S,scheme (e.g. 2,contiguous; default 1)")
    ap.add_argument("--models", help=f"comma-separated candidates (default: all of {', '.join(CANDIDATES)})")
    ap.add_argument("--expect", help="exit 0 only if this model reproduces the output")
    ap.add_argument("--witnesses", help="a folder written by gemm-witnesses (with --outputs)")
    ap.add_argument("--outputs", help="with --witnesses: the device's outputs, one NAME.npy per witness")
    ap.add_argument("--max-mismatches", type=int, default=10)
    ap.add_argument("--json", help="write the report as JSON here")
    a = ap.parse_args(argv)
    try:
        if a.json:
            check_writable(a.json, "--json", inputs=input_paths(a, outputs=("json",)))
        from .matmul16 import MATMUL_CANDIDATES
        from .scaled_mm import FNUZ_CANDIDATES, FP6_CANDIDATES, SCALED_MM_CANDIDATES
        if a.expect and not any(a.expect in c for c in (CANDIDATES, SCALED_MM_CANDIDATES, FNUZ_CANDIDATES,
                                                        FP6_CANDIDATES, MATMUL_CANDIDATES)):
            raise ValueError(f"--expect {a.expect!r}: one of {', '.join(CANDIDATES)} (NVFP4), "
                             f"{', '.join(SCALED_MM_CANDIDATES)} (FP8), cdna3 (FNUZ FP8), b200 (FP6) or "
                             f"{', '.join(MATMUL_CANDIDATES)} (BF16)")
        if a.witnesses or a.outputs:
            if not (a.witnesses and a.outputs):
                raise ValueError("--witnesses and --outputs go together (the witness folder and the device's outputs)")
            man = Path(a.witnesses) / "manifest.json"
            fmt = json.loads(man.read_text()).get("format", "nvfp4") if man.is_file() else "nvfp4"
            if fmt in ("fp8", "fp8-fnuz", "fp6"):
                from .scaled_mm import check_fp8_witnesses
                res = check_fp8_witnesses(a.witnesses, a.outputs, a.out_dtype)
            elif fmt == "bf16":
                from .matmul16 import check_bf16_witnesses
                res = check_bf16_witnesses(a.witnesses, a.outputs, a.out_dtype)
            else:
                res = check_witnesses(a.witnesses, a.outputs, a.out_dtype)
            ok = (a.expect in res["consistent"]) if a.expect else bool(res["consistent"])
            lines = []
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
                lines.append(f"{n}: {got}")
            if res["missing"]:
                lines.append(f"no output for {', '.join(res['missing'])}: the verdict below is over the other "
                             f"{len(res['reports'])} witnesses only")
            lines.append(("consistent with every witness present: " if res["missing"] else
                          "consistent with every witness: ") + (", ".join(res["consistent"]) or "no model"))
            if a.json:
                Path(a.json).write_text(json.dumps({"consistent": res["consistent"], "missing": res["missing"],
                                                    "reports": {
                    n: r.to_dict() for n, r in res["reports"].items()}}, indent=1, default=float) + "\n")
            say("\n".join(lines))
            return 0 if ok else 1
        if not a.out:
            raise ValueError("--out (the kernel's output) is required, or --witnesses with --outputs")
        models = [m.strip() for m in a.models.split(",")] if a.models else None
        if a.a_fp8 or a.b_fp8:
            return _fp8_main(a, models)
        if a.out_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--out-dtype {a.out_dtype}: NVFP4 GEMM outputs are float32 or bfloat16")
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
        return _report(rep, a)
    except (ValueError, TypeError, OSError) as e:
        return _fail(e)


def _report(rep, a) -> int:
    """The JSON first, then the summary (a reader that closes the pipe early loses no result); the exit status."""
    if a.json:
        Path(a.json).write_text(rep.to_json() + "\n")
    say(rep.summary())
    return 0 if (a.expect in rep.matches if a.expect else rep.ok) else 1


def _fp8_operand(path, fmt, flag):
    """An FP8 operand from a file: an ml_dtypes float8 array, or uint8 bytes with their format named."""
    import ml_dtypes
    import numpy as np
    x = load_array(path)
    if x.dtype.kind == "V" and x.dtype.itemsize == 1:
        # np.save of an ml_dtypes float8 array records it as one-byte void records, its format lost
        if not fmt:
            raise ValueError(f"--{flag}-fp8 {path} holds one-byte void records (an ml_dtypes float8 array saved with "
                             f"np.save loses its dtype): name the format with --{flag}-format e4m3 or e5m2")
        x = x.view(np.uint8)
    if x.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        if fmt and fmt != ("e4m3" if x.dtype == np.dtype(ml_dtypes.float8_e4m3fn) else "e5m2"):
            raise ValueError(f"--{flag}-fp8 {path} holds {x.dtype} but --{flag}-format says {fmt}")
        return x
    if x.dtype != np.uint8:
        raise ValueError(f"--{flag}-fp8 {path}: dtype {x.dtype}; give the FP8 bytes as uint8 (with --{flag}-format) "
                         "or an ml_dtypes float8 array")
    if not fmt:
        raise ValueError(f"--{flag}-fp8 holds raw bytes: name their format with --{flag}-format e4m3 or e5m2")
    return x.view(ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2)


def _fp8_main(a, models) -> int:
    import numpy as np

    from .scaled_mm import SCALED_MM_CANDIDATES, compare_scaled_mm
    if not (a.a_fp8 and a.b_fp8):
        raise ValueError("an FP8 GEMM needs both --a-fp8 and --b-fp8")
    missing = [f for f, v in (("--a-scale", a.a_scale), ("--b-scale", a.b_scale)) if v is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (the per-tensor decode scales)")
    if a.expect and a.expect not in SCALED_MM_CANDIDATES:
        raise ValueError(f"--expect {a.expect!r}: for an FP8 GEMM one of {', '.join(SCALED_MM_CANDIDATES)}")
    A = _fp8_operand(a.a_fp8, a.a_format, "a")
    B = _fp8_operand(a.b_fp8, a.b_format, "b")
    sa = np.float32(number_or_array(a.a_scale, True, "--a-scale")).reshape(-1)
    sb = np.float32(number_or_array(a.b_scale, True, "--b-scale")).reshape(-1)
    if sa.size != 1 or sb.size != 1:
        raise ValueError("--a-scale and --b-scale are one value each (per-tensor scales)")
    for flag, v in (("--a-scale", sa[0]), ("--b-scale", sb[0])):
        if not np.isfinite(v):
            raise ValueError(f"{flag} {a.a_scale if flag == '--a-scale' else a.b_scale}: a decode scale is finite; "
                             "give the scale the kernel was called with")
    split = 1
    if a.split_k:
        try:
            S, scheme = a.split_k.split(",")
            split = (int(S), scheme.strip())
        except ValueError:
            raise ValueError(f"--split-k {a.split_k!r}: write it as S,scheme, e.g. 2,contiguous") from None
        from ..tensorcore import MODELS
        known = sorted({s for m in MODELS.values() for s in m.split_schemes})
        if split[1] not in known:
            raise ValueError(f"--split-k {a.split_k!r}: the split scheme is one of {', '.join(known)}")
    from .gemm import load_output
    o = load_array(a.out) if a.out_dtype not in ("float32", "bfloat16") else load_output(a.out, a.out_dtype)
    if o.dtype.kind == "V":                      # an ml_dtypes array saved with np.save: its bits, --out-dtype names them
        o = o.view({1: np.uint8, 2: np.uint16, 4: np.uint32}.get(o.dtype.itemsize, o.dtype))
    rep = compare_scaled_mm(A, B.T, sa[0], sb[0], o, out_dtype=a.out_dtype, candidates=models, split_k=split,
                            max_mismatches=a.max_mismatches)
    return _report(rep, a)


def witnesses_main(argv) -> int:
    from .gemm import write_witnesses
    ap = argparse.ArgumentParser(prog="python -m fp4sim.validate gemm-witnesses", description=WITNESS_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder to write (created; an existing one must be empty)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "fp8", "fp8-fnuz", "fp6", "bf16"],
                    help="nvfp4 (default): the NVFP4 accumulation models; fp8: the tensor-core models of "
                         "torch._scaled_mm (hopper, ada, b200, b200_mma, exact, dequant_f32, fast and slow accumulation); "
                         "fp8-fnuz: AMD MI300's FNUZ FP8 (cdna3, exact, dequant_f32); fp6: E4M3 x E2M3 on Blackwell's "
                         "kind::f8f6f4 (b200, exact, dequant_f32); bf16: the 16-bit models of a bfloat16 matmul "
                         "(hopper = b200_mma, ampere = ada, exact, float32_seq)")
    a = ap.parse_args(argv)
    try:
        if a.format == "bf16":
            from .matmul16 import write_bf16_witnesses
            man = write_bf16_witnesses(a.out, a.seed)
            say(f"wrote {len(man['witnesses'])} BF16 witnesses to {a.out} ({', '.join(man['witnesses'])}); every "
                  f"pair of the {len(man['models'])} models differs in at least "
                  f"{min(man['separating_cells'].values())} cells (float32; bfloat16: "
                  f"{min(man['separating_cells_bf16'].values())})")
            return 0
        if a.format in ("fp8", "fp8-fnuz", "fp6"):
            from .scaled_mm import WITNESS_FAMILIES, write_fp8_witnesses
            man = write_fp8_witnesses(a.out, a.seed, WITNESS_FAMILIES[a.format])
            say(f"wrote {len(man['witnesses'])} {a.format} witnesses to {a.out} ({', '.join(man['witnesses'])}); every "
                  f"pair of the {len(man['models'])} models differs in at least {min(man['separating_cells'].values())}"
                  " cells (float32)")
            return 0
        man = write_witnesses(a.out, a.seed)
    except ValueError as e:
        return _fail(f"--out {e}")
    except OSError as e:
        return _fail(f"--out {a.out}: {e.strerror or e}")
    worst = min(man["separating_cells"].values())
    say(f"wrote {len(man['witnesses'])} witnesses to {a.out} ({', '.join(man['witnesses'])}); every pair of "
          f"the {len(man['models'])} models differs in at least {worst} cells "
          f"(float32; bfloat16: {min(man['separating_cells_bf16'].values())})")
    return 0
