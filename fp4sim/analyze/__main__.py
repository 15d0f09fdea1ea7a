"""``python -m fp4sim.analyze [PATH ...]``: what NVFP4, MXFP4, FP8 and BF16 do to the tensors of a dump.

With no PATH the bundled sample dump (real MiniLM weights, SmolLM2 activations and gradients) is analysed.
Exit status: 0 every tensor analysed, 1 some skipped (listed), 2 nothing analysed or bad arguments.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .core import analyze
from .figures import write_figures
from .inputs import ROLES
from .metrics import SCHEMES_BY_LABEL
from .report import summary, table

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_dump.npz"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4sim.analyze", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help=".npz / .safetensors / TE .pt files or directories (default: sample)")
    ap.add_argument("--out", help="write the xarray Dataset to this netCDF file")
    ap.add_argument("--json", help="write a JSON summary here")
    ap.add_argument("--figures", help="write PNG figures into this directory")
    ap.add_argument("--schemes", help=f"comma-separated subset of {', '.join(SCHEMES_BY_LABEL)}")
    ap.add_argument("--role", action="append", default=[], metavar="PATTERN=ROLE",
                    help=f"set the role of tensors matching a name or glob ({', '.join(ROLES)}); repeatable")
    ap.add_argument("--no-hadamard", action="store_true", help="skip the Hadamard-transform study")
    ap.add_argument("--seed", type=int, default=0, help="seed of the stochastic rounding (Philox)")
    ap.add_argument("--dask", action="store_true", help="analyse tensors in parallel on a local Dask cluster")
    ap.add_argument("--scheduler", help="address of an existing Dask scheduler (implies --dask)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    paths = a.paths or [str(SAMPLE)]
    roles = {}
    for r in a.role:
        pat, sep, role = r.rpartition("=")
        if not sep or role not in ROLES:
            print(f"fp4sim.analyze: --role {r!r}: write it as PATTERN=ROLE with ROLE one of {ROLES}", file=sys.stderr)
            return 2
        roles[pat] = role
    schemes = None
    if a.schemes:
        schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
        bad = [s for s in schemes if s not in SCHEMES_BY_LABEL]
        if bad:
            print(f"fp4sim.analyze: --schemes: unknown {bad}; choose from {list(SCHEMES_BY_LABEL)}", file=sys.stderr)
            return 2
    try:
        ds = analyze(paths, schemes, roles, a.seed, not a.no_hadamard, a.dask or bool(a.scheduler), a.scheduler,
                     quiet=a.quiet)
    except ValueError as e:
        print(f"fp4sim.analyze: {e}", file=sys.stderr)
        return 2
    print(table(ds))
    if a.out:
        ds.to_netcdf(a.out)
        print(f"\nwrote {a.out}")
    if a.json:
        Path(a.json).write_text(json.dumps(summary(ds), indent=1))
        print(f"wrote {a.json}")
    if a.figures:
        files = write_figures(ds, a.figures)
        print("wrote " + ", ".join(str(f) for f in files))
    skipped = json.loads(ds.attrs["skipped"])
    if ds.sizes.get("tensor", 0) == 0:
        return 2
    return 1 if skipped else 0


if __name__ == "__main__":
    raise SystemExit(main())
