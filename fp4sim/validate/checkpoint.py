"""``python -m fp4sim.validate checkpoint DIR [--reference REF] [--json F]``: an NVFP4 checkpoint (ModelOpt or
compressed-tensors export, :mod:`fp4sim.checkpoints.nvfp4`), a gpt-oss MXFP4 folder or a GGUF file's MXFP4 / NVFP4
tensors (:mod:`.checkpoint_mx`), checked tensor by tensor.

Without a reference, every quantized linear's internal consistency: the shapes of its codes, block scales and
tensor scale (a half-size scale tensor, the swizzled layout's padded size, a missing tensor scale), scale bytes
that are NaN or negative, the largest block scale against the tensor scale (448 when the tensor scale comes
from the weight's own amax), a tensor scale whose implied weight amax is implausible while its inverse is not
(a tensor scale stored in the other format's direction), and the excluded modules (each present in high
precision, none quantized). With ``--reference`` (the high-precision weights the checkpoint was made from: a
folder or file analyze reads), each weight is quantized again by each exporter's rule (ModelOpt's: fp4sim's
``modelopt`` flavour; compressed-tensors': :func:`fp4sim.checkpoints.rules.compressed_tensors_quantize`, in each dtype
the reference is exact in) and compared byte for byte, the rule that reproduces it named; a difference is named
where a known fault reproduces the checkpoint's bytes (the tensor scale not inverted, a mixed export, nibbles
swapped, scales swizzled or transposed, scale bytes one binade off, another rule's rounding order).
"""
from __future__ import annotations


import numpy as np

from ..analyze.inputs import reference_sources, reference_weight
from ..checkpoints.compressed_tensors_mx import is_compressed_tensors_mx
from ..checkpoints.gpt_oss import is_gpt_oss
from ..checkpoints.mlx import is_mlx
from ..checkpoints.nvfp4 import KEYS, Checkpoint, QuantWeight, read_checkpoint
from ..formats import E4M3
from ..layout import swizzled_size
from .checkpoint_ref import CheckpointReport, compare_to_reference, count_compared, excluded_findings

__all__ = ["check_checkpoint", "CheckpointReport"]

C2688 = np.float32(2688.0)
PLAUSIBLE_AMAX = (1e-4, 1e4)        # a weight matrix's largest |w| in any model seen: far inside this range


def _decode_scales(b):
    return E4M3.values[np.asarray(b, np.uint8)]


def _structure(v):
    """The share of the variance of log2 scales left within rows and within columns (lower: more structure)."""
    tot = np.nanvar(v)
    if not tot:
        return 1.0
    return float(min(np.nanmean(np.nanvar(v, axis=1)), np.nanmean(np.nanvar(v, axis=0))) / tot)


def _looks_swizzled(sc) -> bool:
    """Scale bytes of the linear shape whose rows and columns show much more structure when read as cuBLAS's
    swizzled 128x4 layout than as rows x blocks (weights have per-row and per-column magnitudes)."""
    from ..layout import unswizzle_scales
    R, B = sc.shape
    if R % 128 or B % 4 or R * B < 512:
        return False
    with np.errstate(divide="ignore", invalid="ignore"):
        lin = np.log2(_decode_scales(sc))
        un = np.log2(_decode_scales(unswizzle_scales(sc.reshape(-1), R, B)))
    lin[~np.isfinite(lin)] = np.nan
    un[~np.isfinite(un)] = np.nan
    # real weights: 0.67 (MiniLM's query) and 0.89 (its FFN) when swizzled; i.i.d. Gaussian weights, which have
    # no structure to find, 0.99 - 1.02 either way
    return _structure(un) < 0.93 * _structure(lin)


def _log2_scales(sc):
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.log2(_decode_scales(sc))
    v[~np.isfinite(v)] = np.nan
    return v


def _looks_transposed(sc) -> bool:
    """Scale bytes of the linear shape (rows, blocks) that show much more structure when read as the transpose
    of a (blocks, rows) matrix: the bytes of ``scales.T`` written with the linear layout's shape. Real weights
    have per-row and per-column magnitudes: MiniLM's FFN weight 0.83 read right against 0.95 transposed; its
    query weight only 0.59 against 0.63, which stays below this threshold (the reference comparison names it)."""
    R, B = sc.shape
    if R == B or R * B < 512 or min(R, B) < 4:
        return False
    return _structure(_log2_scales(sc.reshape(B, R).T)) < 0.93 * _structure(_log2_scales(sc))


def _check_weight(w: QuantWeight, fmt: str) -> tuple[list, list, float | None]:
    """(faults, notes, the largest block scale (None where the scales cannot be read))."""
    kc, ks, kg, _ = KEYS[fmt]
    faults, notes = [], []
    top = None
    codes = w.codes
    if codes.dtype != np.uint8 or codes.ndim != 2:
        return [f"{kc} has dtype {codes.dtype} and {codes.ndim} axes; packed codes are 2-D uint8 (out, in/2)"], [], None
    label = w.dtypes.get("codes", "U8")
    if label != "U8":
        faults.append(f"{kc} is stored as {label}: packed E2M1 codes are U8 (a loader that honours the header reads "
                      "signed bytes and unpacks the high nibbles wrong); its bytes are checked as U8 here")
    R, K = w.shape
    nb = -(-K // 16)
    sc = w.scales
    if sc is None:
        faults.append(f"no block scales ({w.name}.{ks})")
    else:
        want = R * nb
        if sc.size == want and sc.shape == (nb, R) and R != nb:
            faults.append(f"{ks} has shape ({nb}, {R}): blocks x rows, the transpose of the ({R}, {nb}) rows x "
                          "blocks layout checkpoints store (a scale matrix written transposed)")
        elif sc.size == want and sc.shape != (R, nb):
            notes.append(f"{ks} has shape {tuple(sc.shape)}, read as ({R}, {nb})")
        if sc.size == want // 2 and want % 2 == 0 and w.dtypes.get("scales") == "U8" and w.tensor_scale is None:
            faults.append(f"{ks} holds U8 bytes, one per 32 elements, and there is no tensor scale: MXFP4's E8M0 "
                          "exponents (mxfp4-pack-quantized) under a config that names NVFP4")
        elif sc.size == want // 2 and want % 2 == 0:
            faults.append(f"{ks} holds {sc.size} bytes, half of the {R} x {nb} = {want} that {R} rows of {K} "
                          "elements need (a half-size scale tensor: the export wrote one scale per 32 elements or "
                          "dropped half of them)")
        elif sc.size == swizzled_size(R, nb) and sc.size != want:
            faults.append(f"{ks} holds {sc.size} bytes: the size of cuBLAS's swizzled layout (128 x 4 tiles, "
                          f"padded), not the {R} x {nb} linear layout checkpoints store")
        elif sc.size != want:
            faults.append(f"{ks} holds {sc.size} bytes; {R} rows x {nb} blocks = {want} expected")
        else:
            sc = sc.reshape(R, nb)
            nan = int(((sc & 0x7F) == 0x7F).sum())
            neg = int(((sc & 0x80) != 0).sum())
            if nan:
                faults.append(f"{nan} block-scale bytes are E4M3 NaN (0x7F / 0xFF)")
            if neg:
                faults.append(f"{neg} block-scale bytes are negative (sign bit set): scales are magnitudes")
            if not nan:
                top = float(_decode_scales(sc).max())
                if _looks_swizzled(sc):
                    faults.append(f"{ks} looks swizzled: read in cuBLAS's 128x4 layout its rows and columns are far "
                                  "more coherent than read as rows x blocks (a swizzled copy written as linear)")
                elif sc.shape == (R, nb) and _looks_transposed(sc):
                    faults.append(f"{ks} looks transposed: its bytes read as blocks x rows ({nb} x {R}) and "
                                  "transposed have far more coherent rows and columns than read as rows x blocks (a "
                                  "transposed scale matrix written in the linear layout's shape)")
    if w.tensor_scale is None:
        faults.append(f"no tensor scale ({w.name}.{kg}): the weight cannot be dequantized (an MoE expert that lost "
                      "its global scale?)")
    elif not (np.isfinite(w.tensor_scale) and w.tensor_scale > 0):
        faults.append(f"{kg} is {float(w.tensor_scale)!r}: a tensor scale must be finite and positive")
    else:
        lo, hi = PLAUSIBLE_AMAX
        amax = float(w.global_amax)
        alt = float(C2688 / w.tensor_scale) if fmt == "modelopt" else float(C2688 * w.tensor_scale)
        if not lo <= amax <= hi and lo <= alt <= hi:
            how = ("amax / 2688, a multiplier" if fmt == "modelopt" else "2688 / amax, a divisor")
            faults.append(f"{kg} = {float(w.tensor_scale):.6g} looks inverted: read as {how} (this format's "
                          f"convention) the weight's amax is {amax:.4g}, read the other way {alt:.4g}")
        elif not lo <= amax <= hi:
            notes.append(f"{kg} implies a weight amax of {amax:.4g}, outside the usual {lo:g} ... {hi:g}")
    return faults, notes, top


def shared_scale_groups(ck: Checkpoint) -> list:
    """The groups of quantized weights that share one tensor scale: siblings (the same parent module) whose
    stored tensor scales are the same finite, positive float32. ModelOpt's ``export_hf_checkpoint`` and
    llm-compressor give the weights of one fused GEMM (q / k / v, gate / up) the tensor scale of the largest amax
    among them, so that the fused kernel can use one; each weight's block scales and codes are then computed with
    that shared scale. Returns tuples of module names (two or more each), in checkpoint order."""
    by = {}
    for name, w in ck.weights.items():
        ts = w.tensor_scale
        if ts is None or not (np.isfinite(ts) and ts > 0):
            continue
        by.setdefault((name.rpartition(".")[0], np.float32(ts).tobytes()), []).append(name)
    return [tuple(v) for v in by.values() if len(v) > 1]


def _group_summary(groups, kg) -> str:
    """One line for every shared group: how many, of which sibling names."""
    kinds = {}
    for g in groups:
        key = "{" + ", ".join(n.rpartition(".")[2] for n in g) + "}"
        kinds[key] = kinds.get(key, 0) + 1
    what = "; ".join(f"{k} in {n} module{'s' * (n > 1)}" for k, n in kinds.items())
    return (f"{len(groups)} groups of sibling weights share one {kg} ({what}): the fused-GEMM export of ModelOpt's "
            "export_hf_checkpoint and llm-compressor, whose shared scale comes from the group's largest amax")


def check_checkpoint(path, reference=None) -> CheckpointReport:
    """Read and check an NVFP4 checkpoint folder (see the module docstring), or a gpt-oss MXFP4 one
    (:mod:`.checkpoint_mx`); ``reference``: the high-precision
    weights it was made from (each weight is then compared byte for byte, :mod:`.checkpoint_ref`; the weights of
    a shared tensor scale (:func:`shared_scale_groups`) against the group's largest amax)."""
    if str(path).lower().endswith(".gguf"):
        from .checkpoint_mx import check_gguf
        return check_gguf(path, reference)
    if is_gpt_oss(path):
        from .checkpoint_mx import check_gpt_oss
        return check_gpt_oss(path, reference)
    if is_compressed_tensors_mx(path):
        from .checkpoint_mx import check_compressed_tensors_mx
        return check_compressed_tensors_mx(path, reference)
    if is_mlx(path):
        from .checkpoint_mx import check_mlx
        return check_mlx(path, reference)
    ck = read_checkpoint(path)
    kg = KEYS[ck.format][2]
    rep = CheckpointReport(str(path), ck.format, str(reference) if reference else None)
    refs = reference_sources(reference) if reference else None
    groups = shared_scale_groups(ck)
    group_of = {n: g for g in groups for n in g}
    tops = {}
    for name, w in ck.weights.items():
        faults, notes, tops[name] = _check_weight(w, ck.format)
        rep.tensors[name] = {"ok": not faults, "faults": faults, "notes": notes, "shape": list(w.shape),
                             "global_amax": None if w.global_amax is None else float(w.global_amax),
                             "shared_scale": list(group_of.get(name, ())), "exact": None, "rule": None,
                             "rules": []}
    if not ck.weights:
        rep.faults.append(f"no quantized linear found (no {KEYS[ck.format][0]} entry of packed codes): nothing was "
                          "checked")
    if groups:
        rep.notes.append(_group_summary(groups, kg))
    for unit in _units(ck, groups):
        top = [tops[n] for n in unit if tops[n] is not None]
        if top and max(top) != 448.0:
            who = (f"of the weights that share one {kg} ({', '.join(unit)})" if len(unit) > 1 else "")
            rep.tensors[unit[0]]["notes"].append(
                f"the largest block scale {who} is {max(top):g}, not 448: the tensor scale does not come from "
                + ("their largest amax" if len(unit) > 1 else "this weight's own amax (a scale shared with another "
                   "tensor, e.g. fused gate / up, or a calibrated amax)"))
        if refs is not None:
            _compare_unit(ck, unit, refs, rep)
    if refs is not None:
        count_compared(rep)
    excluded_findings(ck, rep)
    return rep


def _units(ck: Checkpoint, groups):
    """The weights in checkpoint order, each shared group as one unit (a tuple of names)."""
    seen = set()
    group_of = {n: g for g in groups for n in g}
    for name in ck.weights:
        if name in seen:
            continue
        unit = group_of.get(name, (name,))
        seen.update(unit)
        yield unit


def _compare_unit(ck: Checkpoint, unit, refs, rep: CheckpointReport):
    """Each weight of ``unit`` against its reference; a shared group's weights with the group's largest amax
    (their references read once, held while the group is compared)."""
    xs = {}
    for n in unit:
        xs[n], why = reference_weight(ck.weights[n], refs)
        if why:
            rep.tensors[n]["notes"].append(f"{why}: not compared")
    amax = None
    if len(unit) > 1:
        am = [np.nanmax(np.abs(x)) for x in xs.values() if x is not None and x.size]
        if len(am) < len(unit):          # a member without its reference: the group's amax is not known
            for n in unit:
                if xs[n] is not None:
                    rep.tensors[n]["notes"].append("not compared: a weight that shares its tensor scale lacks its "
                                                   "reference, so the shared amax is not known")
            return
        amax = np.float32(max(am))
    for n in unit:
        compare_to_reference(ck.weights[n], ck.format, refs, rep.tensors[n], x=xs.pop(n),
                             amax=amax, group=unit if amax is not None else None)
