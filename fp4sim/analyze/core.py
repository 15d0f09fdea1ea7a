"""Running the analysis over a dump and assembling the xarray Dataset."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import xarray as xr
from threadpoolctl import threadpool_limits

from ..threads import numba_threads
from .lazy import specials
from .inputs import NotATarget, Source, TensorError, discover, is_vector_param, load, stored_nbytes
from .metrics import (BLOCK_FIELDS, DEFAULT_SCHEMES, SCALAR_METRICS, SCHEMES_BY_LABEL, scheme_metrics,
                      tensor_amax)
from .studies import RHT_SCHEMES, RHT_SIGNS, absmax_map, gradient_bias, hadamard_effect, outliers, wgrad_gemm

OUTLIER_VARS = ("kurtosis", "max_over_rms", "n_outlier_rows", "n_outlier_cols", "nvfp4_rel_mse",
                "nvfp4_rel_mse_without_outlier_cols", "outlier_block_err_share", "outlier_block_frac")
BIAS_VARS = ("grad_bias_rne", "grad_bias_sr", "grad_bias_sr_expected", "grad_shrink_rne", "grad_shrink_sr",
             "grad_shrink_sr_expected")
WGRAD_VARS = ("wgrad_bias_rne", "wgrad_bias_sr", "wgrad_rel_err_rne", "wgrad_rel_err_sr_one_seed",
              "wgrad_rel_err_sr_mean", "wgrad_rel_var_sr")


def chunk_size(numel: int) -> int:
    """Elements per row chunk: an eighth of the tensor (the analysis holds a few float64 copies of one chunk),
    between 2^16 and 2^22."""
    return int(min(max(numel // 8, 1 << 16), 1 << 22))


def analyze_tensor(src: Source, schemes=DEFAULT_SCHEMES, seed: int = 0, hadamard: bool = True,
                   chunk_elems: int | None = None, stage=None, include_vectors: bool = False,
                   blocks: bool = False, device=None) -> dict:
    """Everything about one tensor (a plain dict, so it can travel back from a Dask worker). ``stage(name)``
    is called as each stage starts (for progress). Every study works in row chunks of ``chunk_elems``
    elements (default: :func:`chunk_size`), so the extra memory stays a small multiple of the tensor. A 1-D bias
    or normalization weight raises :class:`NotATarget` unless ``include_vectors``. ``blocks``: keep each scheme's
    per-block records (:data:`~fp4sim.analyze.metrics.BLOCK_FIELDS`) under ``["schemes"][label]["blocks"]``.
    ``device``: a :class:`fp4sim.analyze.device.Device` to run the studies on (None: the CPU)."""
    stage = stage or (lambda name: None)
    stage("load")
    x = load(src, keep_bf16=device is not None, lazy=device is None)
    if not include_vectors and is_vector_param(src.name, x.ndim):
        what = "a 1-D bias or normalization weight (or attention sinks)" if x.ndim == 1 else \
            "a stack of per-expert biases"
        raise NotATarget(f"{what}: no GEMM operand, so no quantization target (--include-vectors analyses it)")
    ch = chunk_size(x.size) if chunk_elems is None else chunk_elems
    # NumPy's BLAS on one thread: the studies' float64 dot products then give the same bits on any machine and
    # in any Dask worker, and no BLAS worker spins on the cores the next Numba kernel needs; in a Dask worker,
    # Numba's kernels on the worker's own threads (its nthreads), so that workers do not share out the cores
    # twice over
    with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"), _worker_numba_threads():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = {"name": src.name, "role": src.role, "shape": list(x.shape), "numel": int(x.size), "schemes": {}}
        if device is not None:
            from . import device as dev
            x = device.upload(x)
            res["n_nan"], res["n_inf"], amax = dev.specials(device, x)
            run = _OnDevice(device)
        else:
            res["n_nan"], res["n_inf"] = specials(x)
            amax = tensor_amax(x)
            run = _OnCpu
        shared = {}                 # the chunks' scheme-independent sums, taken once
        for spec in schemes:
            if src.role in spec.roles:
                stage(f"scheme {spec.label}")
                recs = [] if blocks else None
                m, chs, sh = run.scheme_metrics(x, spec, src.role, seed, ch, amax, recs, shared=shared)
                res["schemes"][spec.label] = {"metrics": m, "code_hist": chs.tolist(), "scale_hist": sh.tolist()}
                if blocks:
                    res["schemes"][spec.label]["blocks"] = {f: np.concatenate([r[f] for r in recs])
                                                            for f in BLOCK_FIELDS}
        stage("outliers")
        res["outliers"] = run.outliers(x, chunk_elems=ch, amax=amax)
        res["absmax_map"] = run.absmax_map(x, chunk_elems=ch).tolist()
        if hadamard:
            stage("Hadamard study")
            dims, err, kur = run.hadamard_effect(x, seed, res["outliers"]["kurtosis"], chunk_elems=ch, amax=amax)
            res["rht"] = {"dims": list(dims), "rel_mse": err.tolist(), "kurtosis": kur.tolist()}
        if src.role == "gradient":
            stage("gradient bias")
            res["bias"] = run.gradient_bias(x, seed, chunk_elems=ch)
        if device is not None:
            device.k.poll_warnings(wait=True)   # the device's deferred input warnings, ignored here as on the CPU
    return res


class _OnCpu:
    """The studies on the CPU."""
    scheme_metrics = staticmethod(scheme_metrics)
    outliers = staticmethod(outliers)
    absmax_map = staticmethod(absmax_map)
    hadamard_effect = staticmethod(hadamard_effect)
    gradient_bias = staticmethod(gradient_bias)
    wgrad_gemm = staticmethod(wgrad_gemm)


class _OnDevice:
    """The studies of :mod:`fp4sim.analyze.device` on one device."""

    def __init__(self, dv):
        import functools

        from . import device as dev
        for name in ("scheme_metrics", "outliers", "absmax_map", "hadamard_effect", "gradient_bias", "wgrad_gemm"):
            setattr(self, name, functools.partial(getattr(dev, name), dv))


def resolve_device(device):
    """``analyze``'s ``device`` as a :class:`fp4sim.analyze.device.Device`, or None for the CPU: "cpu" (or None),
    "cuda" (the current CUDA device, through CuPy) or a CUDA backend of :mod:`fp4sim.gpu.backend`."""
    if device is None or device == "cpu":
        return None
    from .device import Device
    if isinstance(device, Device):
        return device
    if device == "cuda":
        from .. import gpu
        if not gpu.available():
            raise ValueError("device='cuda' needs CuPy and a CUDA device: none was found (install CuPy with pip "
                             "install '.[gpu]' from the repository root, or analyse on the CPU with device='cpu')")
        from ..gpu.backend import default_backend
        return Device(default_backend())
    if hasattr(device, "launch") and hasattr(device, "xp"):
        return Device(device)
    raise ValueError(f"device={device!r}: give 'cpu' or 'cuda'")


def _worker_numba_threads():
    """Within a Dask worker, Numba's thread count (for the calling thread) set to the worker's ``nthreads``."""
    n = None
    if "distributed" in sys.modules:
        try:
            from distributed import get_worker
            n = get_worker().state.nthreads
        except (ValueError, AttributeError):
            n = None                                     # not in a worker
    return numba_threads(n)


class _Progress:
    """Progress over tensors and their stored bytes and, within one tensor, its current stage (tqdm on stderr;
    nothing when quiet). ``nbytes``: each source's stored size (:func:`~fp4sim.analyze.inputs.stored_nbytes`)."""

    def __init__(self, n, quiet, nbytes: dict | None = None):
        self.bar = None
        self.nbytes = nbytes or {}
        self.total = sum(self.nbytes.values())
        self.read = 0
        if not quiet and n:
            from tqdm import tqdm
            self.bar = tqdm(total=n, unit="tensor", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

    def stage(self, name, what):
        if self.bar is not None:
            size = f"{_size(self.read)} of {_size(self.total)} · " if self.total else ""
            self.bar.set_postfix_str(size + f"{name}: {what}"[-100:], refresh=True)

    def done(self, name=None):
        self.read += self.nbytes.get(name, 0)
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.set_postfix_str(f"{_size(self.read)} of {_size(self.total)}" if self.total else "")
            self.bar.close()


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class Parts:
    """Per-tensor results kept as they finish (one file per tensor in a folder), so that an interrupted analysis
    resumes: a tensor's file is used again only when its source (path, key, size and modification time of the
    file) and every argument that changes its numbers are the same."""

    def __init__(self, folder, config: dict):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config

    def _file(self, src):
        return self.dir / (hashlib.sha1(f"{src.path}\0{src.key}\0{src.name}".encode()).hexdigest() + ".pkl")

    def _stamp(self, src) -> dict:
        st = os.stat(src.path)
        return {"path": str(src.path), "key": src.key, "name": src.name, "role": src.role, "size": st.st_size,
                "mtime_ns": st.st_mtime_ns, **self.config}

    def get(self, src):
        """The stored outcome of ``src`` — ("result", dict) or ("skipped", dict) — or None."""
        f = self._file(src)
        try:
            with open(f, "rb") as fh:
                stamp, outcome = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            return None
        return outcome if stamp == self._stamp(src) else None

    def put(self, src, kind: str, value: dict):
        f = self._file(src)
        tmp = f.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            pickle.dump((self._stamp(src), (kind, value)), fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, f)


def _killed(name, e) -> dict:
    return {"tensor": name, "reason": f"it killed every Dask worker that analysed it ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:200]}); most likely out of memory: analyse it "
                                      "with fewer workers per machine or more memory per worker"}


def analyze(paths, schemes=None, role_overrides=None, seed: int = 0, hadamard: bool = True, dask: bool = False,
            scheduler: str | None = None, chunk_elems: int | None = None, quiet: bool = False,
            client=None, include_vectors: bool = False, blocks: str | None = None, resume=None,
            device=None) -> xr.Dataset:
    """Analyse every tensor under ``paths``; returns the Dataset (``ds.attrs['skipped']`` lists what was not
    analysed and why, as JSON; entries with ``"ignored": true`` are no quantization targets — integer buffers,
    and biases and normalization weights unless ``include_vectors`` — rather than failures). ``blocks``: also write
    the per-block records of every tensor and scheme to this netCDF file (:func:`blocks_dataset`). ``resume``: a
    folder where each tensor's result is kept as it finishes; a rerun with the same arguments reads them back
    instead of analysing those tensors again, and returns the same Dataset as an uninterrupted run. On a Dask
    cluster a tensor whose worker dies is retried on another (Dask's ``allowed-failures``); one that keeps
    killing workers (out of memory) is reported as skipped with that reason. ``device``: "cpu" (the default) or
    "cuda": the studies on the current CUDA device through CuPy (:mod:`fp4sim.analyze.device`: the CPU's codes,
    counts and per-block values, its float64 sums to the reassociation tolerance); not with Dask."""
    dv = resolve_device(device)
    if dv is not None and (dask or scheduler or client is not None):
        raise ValueError("device='cuda' runs on one GPU in this process: leave out dask / scheduler / client")
    specs = DEFAULT_SCHEMES if schemes is None else tuple(SCHEMES_BY_LABEL[s] if isinstance(s, str) else s
                                                          for s in schemes)
    sources, problems, meta = discover(paths, role_overrides)
    results, skipped = [], [{"tensor": p, "reason": r} for p, r in problems]
    n_pairs = len(meta.get("pairs", {}))
    prog = _Progress(len(sources) + n_pairs, quiet,        # the weight-gradient GEMMs of the pairs come last
                     None if quiet else {s.name: stored_nbytes(s) for s in sources})
    parts = None
    if resume is not None:
        parts = Parts(resume, {"schemes": [sp.label for sp in specs], "seed": int(seed), "hadamard": bool(hadamard),
                               "chunk_elems": chunk_elems, "include_vectors": bool(include_vectors),
                               "blocks": bool(blocks), "device": "cpu" if dv is None else "cuda"})
    todo = []
    for s in sources:
        got = parts.get(s) if parts is not None else None
        if got is None:
            todo.append(s)
            continue
        (results if got[0] == "result" else skipped).append(got[1])
        prog.stage(s.name, "read back from an earlier run")
        prog.done(s.name)

    def finished(s, kind, value):
        (results if kind == "result" else skipped).append(value)
        if parts is not None:
            parts.put(s, kind, value)

    if todo and (dask or scheduler or client is not None):
        from dask.distributed import Client, LocalCluster, as_completed
        from distributed.scheduler import KilledWorker
        own = client is None
        cluster = None                  # a Client given a cluster does not own it: closed here, with the client
        if own:
            if scheduler:
                client = Client(scheduler, timeout=10)
            else:
                cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
                client = Client(cluster)
        try:
            futs = {client.submit(analyze_tensor, s, specs, seed, hadamard, chunk_elems, None, include_vectors,
                                  bool(blocks), pure=False): s for s in todo}
            for f in as_completed(futs):
                s = futs[f]
                try:
                    finished(s, "result", f.result())
                except TensorError as e:
                    finished(s, "skipped", _skip(s.name, e))
                except KilledWorker as e:
                    skipped.append(_killed(s.name, e))          # not kept: a rerun with more memory tries again
                prog.stage(s.name, "analysed on the cluster")
                prog.done(s.name)
        finally:
            if own:
                client.close()
            if cluster is not None:
                cluster.close()
    else:
        for s in todo:
            try:
                finished(s, "result", analyze_tensor(s, specs, seed, hadamard, chunk_elems,
                                                     stage=lambda what, s=s: prog.stage(s.name, what),
                                                     include_vectors=include_vectors, blocks=bool(blocks),
                                                     device=dv))
            except TensorError as e:
                finished(s, "skipped", _skip(s.name, e))
            prog.done(s.name)
    order = {s.name: i for i, s in enumerate(sources)}
    results.sort(key=lambda r: order[r["name"]])
    skipped = ([k for k in skipped if k["tensor"] not in order]            # listing problems, then by source
               + sorted((k for k in skipped if k["tensor"] in order), key=lambda k: order[k["tensor"]]))
    pairs = []
    byname = {r["name"]: r for r in results}
    for pname, (a, g) in meta.get("pairs", {}).items():
        if a in byname and g in byname:
            prog.stage(pname, "weight-gradient GEMM")
            try:
                xa, xg = (load(_src(sources, n), keep_bf16=dv is not None) for n in (a, g))
                pair = (wgrad_gemm(xa, xg) if dv is None else
                        _OnDevice(dv).wgrad_gemm(dv.upload(xa), dv.upload(xg)))
                pairs.append({"pair": pname, **pair})
            except (TensorError, ValueError) as e:
                skipped.append({"tensor": pname, "reason": f"weight-gradient GEMM: {e}"})
        prog.done()
    prog.close()
    if blocks:
        blocks_dataset(results).to_netcdf(blocks)
    return to_dataset(results, pairs, specs, skipped, meta)


def blocks_dataset(results) -> xr.Dataset:
    """The per-block records of :func:`analyze_tensor` results (run with ``blocks=True``) as one table, dimension
    ``record``: ``tensor`` and ``scheme`` (indices into the coordinates ``tensor_name`` and ``scheme_name``),
    ``row`` and ``block`` (the 1 x B segment of the tensor's (rows, last axis) view; B the scheme's block length,
    the whole row for per-tensor schemes), ``scale_byte`` (E4M3 for NVFP4, UE8M0 for MX; -1 where the scheme has
    no byte scales), ``amax`` (the segment's max |x|), ``sq_err`` (its squared quantization error: a tensor's
    errors sum to ``mse * numel``) and ``lost`` (how many of its finite values came back Inf or NaN: then its
    ``sq_err`` is +Inf, as the tensor's mse is). Select one tensor and scheme with ``b.isel(record=(b.tensor == i) &
    (b.scheme == j))``."""
    names = [r["name"] for r in results]
    labels = list(dict.fromkeys(lab for r in results for lab in r["schemes"]))
    cols = {f: [] for f in ("tensor", "scheme") + BLOCK_FIELDS}
    for i, r in enumerate(results):
        for lab, d in r["schemes"].items():
            b = d.get("blocks")
            if b is None:
                continue
            n = len(b["row"])
            cols["tensor"].append(np.full(n, i, np.int32))
            cols["scheme"].append(np.full(n, labels.index(lab), np.int16))
            for f in BLOCK_FIELDS:
                cols[f].append(b[f])
    empty = {"tensor": np.int32, "scheme": np.int16, "row": np.int32, "block": np.int32, "scale_byte": np.int16,
             "amax": np.float32, "sq_err": np.float64, "lost": np.int32}
    data = {f: ("record", np.concatenate(v) if v else np.zeros(0, empty[f])) for f, v in cols.items()}
    ds = xr.Dataset(data, coords={"tensor_name": ("tensor_index", names), "scheme_name": ("scheme_index", labels)})
    ds.attrs["producer"] = "fp4sim.analyze --blocks"
    ds.attrs["description"] = ("one record per block segment (1 x B along the last axis) per tensor and scheme; "
                               "tensor / scheme index tensor_name / scheme_name; scale_byte -1: no byte scales; "
                               "sq_err sums to the tensor's mse * numel; lost: finite values that came back Inf / "
                               "NaN, and then sq_err is +Inf")
    return ds


def _skip(name, e) -> dict:
    d = {"tensor": name, "reason": str(e)}
    if isinstance(e, NotATarget):
        d["ignored"] = True
    return d


def _src(sources, name):
    return next(s for s in sources if s.name == name)


def to_dataset(results, pairs, specs, skipped, meta) -> xr.Dataset:
    names = [r["name"] for r in results]
    labels = [s.label for s in specs]
    nt, ns = len(names), len(labels)
    data = {m: np.full((nt, ns), np.nan) for m in SCALAR_METRICS}
    code_hist = np.zeros((nt, ns, 16), np.int64)
    scale_hist = np.zeros((nt, ns, 256), np.int64)
    for i, r in enumerate(results):
        for j, lab in enumerate(labels):
            if lab in r["schemes"]:
                for m, v in r["schemes"][lab]["metrics"].items():
                    data[m][i, j] = v
                code_hist[i, j] = r["schemes"][lab]["code_hist"]
                scale_hist[i, j] = r["schemes"][lab]["scale_hist"]
    ds = xr.Dataset(
        {m: (("tensor", "scheme"), v) for m, v in data.items()},
        coords={"tensor": names, "scheme": labels, "code": np.arange(16), "scale_byte": np.arange(256),
                "role": ("tensor", [r["role"] for r in results]),
                "numel": ("tensor", [r["numel"] for r in results])})
    ds["code_hist"] = (("tensor", "scheme", "code"), code_hist)
    ds["scale_hist"] = (("tensor", "scheme", "scale_byte"), scale_hist)
    ds["absmax_map"] = (("tensor", "map_row", "map_col"), np.array([r["absmax_map"] for r in results], np.float32)
                        .reshape(nt, 64, 64))
    ds["absmax_map"].attrs["description"] = "max |x| pooled onto a 64 x 64 grid of the (rows, last axis) view"
    for v in OUTLIER_VARS:
        ds[v] = ("tensor", [float(r["outliers"][v]) for r in results])
    for v, what in (("n_nan", "NaN"), ("n_inf", "+-Inf")):
        ds[v] = ("tensor", np.array([r.get(v, 0) for r in results], np.int64))
        ds[v].attrs["description"] = (f"{what} elements of the tensor (left out of every error sum; the schemes' "
                                      "handling of them shows in lost_frac and the code histograms)")
    for v in BIAS_VARS:
        ds[v] = ("tensor", [float(r.get("bias", {}).get(v, np.nan)) for r in results])
    if results and "rht" in results[0]:
        dims = results[0]["rht"]["dims"]
        ds = ds.assign_coords(rht_d=dims, rht_signs=list(RHT_SIGNS), rht_scheme=list(RHT_SCHEMES))
        ds["rht_rel_mse"] = (("tensor", "rht_d", "rht_signs", "rht_scheme"),
                             np.array([r["rht"]["rel_mse"] for r in results], float))
        ds["rht_kurtosis"] = (("tensor", "rht_d", "rht_signs"), np.array([r["rht"]["kurtosis"] for r in results],
                                                                          float))
    status = np.full((nt, ns), "not applied", dtype=object)
    for i, r in enumerate(results):
        for j, lab in enumerate(labels):
            if lab in r["schemes"]:
                mse, rel = data["mse"][i, j], data["rel_mse"][i, j]
                status[i, j] = ("lost" if data["lost_frac"][i, j] > 0 else "degenerate" if not np.isfinite(rel)
                                else "exact" if mse == 0 else "ok")
    ds["status"] = (("tensor", "scheme"), status.astype(str))
    ds["status"].attrs["description"] = ("'ok'; 'exact' (no error at all); 'lost' (finite values come back Inf or "
                                         "NaN, e.g. NVFP4 with an Inf tensor amax: errors unbounded, lost_frac "
                                         "says how many); 'degenerate' (no finite nonzero value: relative errors "
                                         "undefined); 'not applied' (the scheme is not used for this role)")
    ds["lost_frac"].attrs["description"] = "share of the finite elements that quantize-dequantize to Inf or NaN"
    if pairs:
        ds = ds.assign_coords(pair=[p["pair"] for p in pairs])
        for v in WGRAD_VARS:
            ds[v] = ("pair", [p[v] for p in pairs])
        ds["wgrad_rht"] = ("pair", [bool(p["rht"]) for p in pairs])
        ds["wgrad_tokens"] = ("pair", [int(p["tokens"]) for p in pairs])
    for v, desc in (("sqnr_db", "signal-to-quantization-noise ratio, dB"), ("rel_mse", "MSE / mean(x^2)"),
                    ("underflow_frac", "share of nonzero elements that quantize to 0"),
                    ("frac_blocks_amax_max", "share of blocks whose amax element codes to +-6 (FP4)"),
                    ("binades_per_block", "mean count of E2M1 binades used per block (FP4)"),
                    ("worst1pct_block_err_share", "share of squared error in the worst 1% of blocks")):
        ds[v].attrs["description"] = desc
    ds.attrs["skipped"] = json.dumps(skipped)
    ds.attrs["sources"] = json.dumps(meta.get("sources", {}))
    ds.attrs["producer"] = "fp4sim.analyze"
    return ds
