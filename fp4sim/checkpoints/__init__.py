"""The FP4 checkpoint formats users hold, one module each, and the exporter rules they are checked against.

- :mod:`.nvfp4`: ModelOpt's and compressed-tensors' NVFP4 Hugging Face folders (:func:`read_checkpoint`);
- :mod:`.gpt_oss`: gpt-oss's MXFP4 safetensors folders (:func:`read_gpt_oss`);
- :mod:`.gguf`: llama.cpp's GGUF files with ggml's MXFP4 and NVFP4 block types (:func:`read_gguf`);
- :mod:`.rules`: the registry of exporter rules (:data:`RULES`), each a function from a high-precision weight to
  the bytes an exporter writes, with its provenance;
- :mod:`.faults`: the table of layout faults fp4sim names (:data:`FAULTS`) and the transforms that undo them;
- :mod:`.folders`: what the safetensors formats share (a folder's entries, their headers, its JSON configs);
- :mod:`.records`: the weight record every reader gives (``name``, ``shape``, ``codes`` in fp4sim's packing,
  ``scales`` as stored, ``tensor_scale``, ``layout``, ``values()``) and each format's ``Layout``.

``fp4sim.checkpoint``, ``fp4sim.gguf`` and ``fp4sim.gpt_oss`` re-export the public names of the modules they were
before.
"""
from .faults import FAULTS, LayoutFault, faults_table
from .gguf import FP4_TYPES, GGUFFile, GGUFTensor, read_gguf
from .gpt_oss import GptOssCheckpoint, MXFP4Weight, is_gpt_oss, read_gpt_oss
from .nvfp4 import Checkpoint, QuantWeight, dequantize_weight, is_checkpoint, read_checkpoint
from .records import LAYOUTS, Layout
from .rules import RULES, ExporterRule, Requantized, RuleBytes, reproducing, rule, rule_costs, rules_table

__all__ = ["read_checkpoint", "Checkpoint", "QuantWeight", "dequantize_weight", "is_checkpoint", "read_gpt_oss",
           "is_gpt_oss", "GptOssCheckpoint", "MXFP4Weight", "read_gguf", "GGUFFile", "GGUFTensor", "FP4_TYPES",
           "RULES", "ExporterRule", "RuleBytes", "Requantized", "rule", "reproducing", "rule_costs", "rules_table",
           "FAULTS", "LayoutFault", "faults_table", "Layout", "LAYOUTS"]
