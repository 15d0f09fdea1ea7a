"""llama.cpp's GGUF FP4 tensors: moved to :mod:`fp4sim.checkpoints.gguf` (the reader and ggml's block layout) and
:mod:`fp4sim.checkpoints.rules` (ggml's quantizers, TE's rule per 32, the rules' costs); this module keeps their
public names."""
from .checkpoints.gguf import (FP4_TYPES, GGUFFile, GGUFTensor, block_layout, from_ggml_order, other_fp4_bytes,
                               read_gguf, to_ggml_order, to_gguf_blocks)
from .checkpoints.rules import (BITS_PER_VALUE, COST_RULES, ggml_mxfp4_quantize, ggml_nvfp4_quantize, ggml_ue4m3,
                                rule_costs, te_nvfp4_blocks)

__all__ = ["read_gguf", "GGUFFile", "GGUFTensor", "block_layout", "ggml_mxfp4_quantize", "ggml_nvfp4_quantize",
           "ggml_ue4m3", "rule_costs", "te_nvfp4_blocks", "other_fp4_bytes", "to_ggml_order", "from_ggml_order",
           "to_gguf_blocks", "FP4_TYPES", "COST_RULES", "BITS_PER_VALUE"]
