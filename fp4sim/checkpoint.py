"""NVFP4 checkpoints (ModelOpt, compressed-tensors): moved to :mod:`fp4sim.checkpoints.nvfp4` (the reader) and
:mod:`fp4sim.checkpoints.rules` (``compressed_tensors_quantize``); this module keeps their public names."""
from .checkpoints.nvfp4 import (FORMATS, KEYS, Checkpoint, QuantWeight, dequantize_weight, detect, excluded_by,
                                is_checkpoint, read_checkpoint)
from .checkpoints.rules import compressed_tensors_quantize

__all__ = ["read_checkpoint", "Checkpoint", "QuantWeight", "FORMATS", "is_checkpoint", "dequantize_weight",
           "compressed_tensors_quantize", "excluded_by", "detect", "KEYS"]
