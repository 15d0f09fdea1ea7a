"""Tensor cores as the silicon computes them: published bit-accurate models of NVIDIA's matrix units, the
order in which a library walks K and combines partials, and the epilogue.

The inner product (``models.py``: parameters; ``accumulate.py``: the chain; the kernel in ``fp4sim/cpu``): a
tensor core does not round like IEEE arithmetic. Per instruction step it takes ``nfma`` products, aligns them to
the largest product exponent (and the running accumulator's), truncates each aligned term toward zero to
``frac`` fraction bits, sums exactly, truncates the sum to ``frac_out`` bits and feeds it back as the next step's
addend (Khattak and Mikaitis, ACM TACO 2026, validated against V100 ... B200 hardware).

The library (``accumulate.plan``): cuBLAS's FP8 GEMMs restart the chain every 128 K elements under slow
accumulation and add the restarts in float32; split-K partials are combined in measured orders (mmaemu).

AMD's CDNA3 (MI300) matrix cores (``cdna.py``, ``mfma``): MMA-Sim's MFMA models, FP8 FNUZ, BF16 and FP16.

The epilogue (``scaled_mm.epilogue``): alpha = RN32(scale_a · scale_b), y = RN32(acc · alpha), then the output
dtype. ``scaled_mm`` puts the three together with the arguments of ``torch._scaled_mm``.
"""
from .accumulate import accumulate, chain, chain_runs, plan
from .blockscaled import tcgen05_fp4, tcgen05_fp8
from .cdna import mfma
from .models import MODELS, BlockFMA, TensorCoreModel, get_model
from .scaled_mm import epilogue, scaled_mm

__all__ = ["scaled_mm", "accumulate", "chain", "chain_runs", "plan", "epilogue", "tcgen05_fp4", "tcgen05_fp8", "mfma", "MODELS",
           "BlockFMA", "TensorCoreModel", "get_model"]
