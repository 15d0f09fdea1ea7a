"""``python -m fp4sim.analyze [PATH ...]``: what NVFP4, MXFP4, FP8 and BF16 do to the tensors of a dump.

With no PATH the bundled sample dump (real MiniLM weights, SmolLM2 activations and gradients) is analysed.
Exit status: 0 every tensor analysed, 1 some skipped (listed), 2 nothing analysed or bad arguments. Entries that
are no quantization target (integer buffers such as position_ids; biases and normalization weights unless
--include-vectors) are listed as not analysed and leave the status at 0. With --out, an interrupted analysis
resumes where it stopped when rerun with the same arguments; on a Dask cluster a tensor whose worker dies is
retried, and one that keeps killing workers (out of memory) is skipped with that reason.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import threads
from ..arrays_io import check_writable, input_paths
from .._tool import say
from .core import analyze
from .figures import write_figures
from .inputs import ROLES, SUFFIXES
from .metrics import SCHEMES_BY_LABEL
from .report import summary, table

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_dump.npz"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4sim.analyze", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help=".npy / .npz / .safetensors / .pt / .pth files (a tensor, a state_dict or TE's dumps) or "
                         "directories of them (default: the bundled sample)")
    ap.add_argument("--out", help="write the xarray Dataset to this netCDF file (each tensor's result is kept in "
                                  "OUT.parts/ as it finishes, so a rerun with the same arguments after an "
                                  "interruption resumes; the folder goes once OUT is written)")
    ap.add_argument("--json", help="write a JSON summary here")
    ap.add_argument("--blocks", metavar="FILE.nc",
                    help="write per-block records here (netCDF): per tensor and scheme, every block's scale byte, "
                         "amax and squared error (a tensor's errors sum to its total)")
    ap.add_argument("--figures", help="write PNG figures into this directory")
    ap.add_argument("--schemes", help=f"comma-separated subset of {', '.join(SCHEMES_BY_LABEL)}")
    ap.add_argument("--role", action="append", default=[], metavar="PATTERN=ROLE",
                    help=f"set the role of tensors matching a name or glob ({', '.join(ROLES)}); repeatable")
    ap.add_argument("--no-hadamard", action="store_true", help="skip the Hadamard-transform study")
    ap.add_argument("--include-vectors", action="store_true",
                    help="also analyse biases, attention sinks and normalization weights (1-D; gpt-oss's per-expert "
                         "biases, 2-D), skipped by default: no GEMM takes them")
    ap.add_argument("--seed", type=int, default=0, help="seed of the stochastic rounding (Philox), 0 <= N < 2**64")
    ap.add_argument("--threads", type=int, help="Numba threads (default: the idle cores, from the load average)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the studies run: cpu (default) or cuda (the current CUDA device through CuPy, pip "
                         "install '.[gpu]'; the same codes, counts and per-block values as the CPU, float64 sums to "
                         "the reassociation tolerance; not with --dask)")
    ap.add_argument("--dask", action="store_true", help="analyse tensors in parallel on a local Dask cluster")
    ap.add_argument("--scheduler", help="address of an existing Dask scheduler (implies --dask)")
    ap.add_argument("--requantize", metavar="REF",
                    help="for the FP4 tensors of GGUF files and gpt-oss MXFP4 folders among PATHS: what their rule "
                         "cost against fp4sim's other FP4 rules on the high-precision weights REF (any format "
                         "analyze reads, under the same names): each rule's relative error beside the stored "
                         "values', and the share of blocks that clip (in the report and the --json summary); exit "
                         "1 when some FP4 tensor could not be compared (listed), 2 when none could")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except BadInput as e:
        print(f"fp4sim.analyze: bad input: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


class BadInput(ValueError):
    pass


def _run(a) -> int:
    paths = a.paths or [str(SAMPLE)]
    roles = {}
    for r in a.role:
        pat, sep, role = r.rpartition("=")
        if not sep or not pat or role not in ROLES:
            raise BadInput(f"--role {r!r}: write it as PATTERN=ROLE with ROLE one of {', '.join(ROLES)}")
        roles[pat] = role
    schemes = None
    if a.schemes is not None:
        schemes = [s.strip() for s in a.schemes.split(",") if s.strip()]
        bad = [s for s in schemes if s not in SCHEMES_BY_LABEL]
        if not schemes:
            raise BadInput(f"--schemes {a.schemes!r}: names no scheme; give one or more of "
                           f"{', '.join(SCHEMES_BY_LABEL)}, separated by commas (or leave --schemes out for all)")
        if bad:
            raise BadInput(f"--schemes: unknown {bad}; choose from {', '.join(SCHEMES_BY_LABEL)}")
    if not 0 <= a.seed < 1 << 64:
        raise BadInput(f"--seed {a.seed}: give an integer in [0, 2**64)")
    if a.device == "cuda":
        if a.dask or a.scheduler:
            raise BadInput("--device cuda runs on one GPU in this process: leave out --dask / --scheduler")
        from .. import gpu
        if not gpu.available():
            raise BadInput("--device cuda: no CUDA device with CuPy was found (install CuPy with pip install "
                           "'.[gpu]' from the repository root, or leave out --device)")
    try:
        if a.threads is not None and a.threads < 1:
            raise ValueError(f"--threads {a.threads}: give a positive number of threads (or leave it out: the idle "
                             "cores)")
        threads.configure(a.threads)
        outs = {"out": a.out, "json": a.json, "blocks": a.blocks, "figures": a.figures}
        ins = input_paths(a, outputs=tuple(outs))
        given = [(k, v) for k, v in outs.items() if v]
        for i, (k, v) in enumerate(given):
            same = next((k2 for k2, v2 in given[:i] if Path(v2).resolve() == Path(v).resolve()), None)
            if same:
                raise ValueError(f"--{k} {v}: --{same} names the same path; give each output its own")
            check_writable(v, f"--{k}", directory=k == "figures", inputs=ins)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if a.requantize:
        from ..requantize import fp4_tensors
        try:
            if not Path(a.requantize).exists():
                raise ValueError(f"--requantize {a.requantize}: no such file or folder (give the high-precision "
                                 "weights)")
            if not fp4_tensors(paths):
                raise ValueError("--requantize: none of the paths holds an FP4 tensor of a GGUF file (MXFP4, "
                                 "NVFP4) or a gpt-oss MXFP4 folder")
        except (ValueError, ImportError) as e:
            raise BadInput(str(e)) from None
    client = None
    if a.scheduler:
        client = _connect(a.scheduler)
    try:
        ds = analyze(paths, schemes, roles, a.seed, not a.no_hadamard, a.dask, None, quiet=a.quiet, client=client,
                     include_vectors=a.include_vectors, blocks=a.blocks, resume=_parts(a), device=a.device)
    except ValueError as e:  # a broken roles file, names that cannot be told apart
        raise BadInput(str(e)) from None
    finally:
        if client is not None:
            client.close()
    skipped = json.loads(ds.attrs["skipped"])
    if ds.sizes.get("tensor", 0) == 0:
        where = ", ".join(paths)
        if skipped:
            for sk in skipped:
                print(f"  skipped {sk['tensor']}: {sk['reason']}", file=sys.stderr)
            print(f"fp4sim.analyze: nothing analysed: every tensor under {where} was skipped (reasons above)",
                  file=sys.stderr)
        else:
            print(f"fp4sim.analyze: nothing analysed: no tensors found under {where} (looked for "
                  f"{', '.join(SUFFIXES)} files)", file=sys.stderr)
        return 2
    study = None
    if a.requantize:
        from ..requantize import requantize_study, requantize_table
        _say(a, f"re-quantizing the reference weights {a.requantize}")
        try:
            study = requantize_study(paths, a.requantize)
        except ValueError as e:
            raise BadInput(str(e)) from None
        if not study["tensors"]:                  # a study that compares nothing is no result
            why = "; ".join(f"{n}: {w}" for n, w in study["not_compared"][:3])
            raise BadInput(f"--requantize {a.requantize}: no FP4 tensor could be compared with it ({why})")
        ds.attrs["requantize"] = json.dumps(study)
    # the outputs first, then the table: a reader that closes the pipe early (| head) loses no result
    done = [f"wrote {a.blocks}"] if a.blocks else []
    try:
        if a.out:
            _say(a, f"writing {a.out}")
            ds.to_netcdf(a.out)
            done.append(f"wrote {a.out}")
            import shutil
            shutil.rmtree(_parts(a), ignore_errors=True)        # the run is complete: its kept parts are done
        if a.json:
            js = summary(ds)
            if study is not None:
                js["requantize"] = study
            Path(a.json).write_text(json.dumps(js, indent=1))
            done.append(f"wrote {a.json}")
        if a.figures:
            _say(a, f"drawing the figures into {a.figures}")
            files = write_figures(ds, a.figures)
            done.append(f"wrote {len(files)} figures into {a.figures}: " + ", ".join(Path(f).name for f in files))
    except OSError as e:
        raise BadInput(f"writing the results: {e}") from None
    more = "\n\n" + requantize_table(study) if study is not None else ""
    say(table(ds) + more + ("\n\n" + "\n".join(done) if done else ""))
    short = study is not None and bool(study["not_compared"])          # listed in the report, with the reason
    return 1 if short or any(not sk.get("ignored") for sk in skipped) else 0


def _parts(a):
    """The folder beside --out where each tensor's result is kept as it finishes (None without --out): a rerun
    with the same arguments after an interruption reads them back; removed once --out is written."""
    return None if not a.out else str(a.out) + ".parts"


def _say(a, what: str):
    """A stage after the per-tensor progress bar, on stderr (nothing with --quiet)."""
    if not a.quiet:
        print(f"fp4sim.analyze: {what} ...", file=sys.stderr, flush=True)


def _connect(address):
    """A Dask client for --scheduler, or BadInput within a few seconds when nothing answers there."""
    try:
        from dask.distributed import Client
    except ImportError:
        raise BadInput("--scheduler needs Dask: pip install 'dask[distributed]' (or '.[dask]' from the repository root)") from None
    try:
        return Client(address, timeout=5)
    except (OSError, TimeoutError, ValueError) as e:
        raise BadInput(f"--scheduler {address}: no Dask scheduler answered ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:160]})") from None


if __name__ == "__main__":
    from .._tool import run_tool
    raise SystemExit(run_tool(main, "fp4sim.analyze"))
