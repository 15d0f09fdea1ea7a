"""gpt-oss's MXFP4 safetensors checkpoints: moved to :mod:`fp4sim.checkpoints.gpt_oss` (the MXFP4 rules it is
checked against are the registry's, :mod:`fp4sim.checkpoints.rules`); this module keeps its public names."""
from .checkpoints.gpt_oss import (MX_RULES, STORED, TRANSPOSED, GptOssCheckpoint, MXFP4Weight, is_gpt_oss,
                                  match_readings, matching_orientation, read_gpt_oss, reference_orientations,
                                  reference_rows, reproducing_rules, rule_bytes)

__all__ = ["is_gpt_oss", "read_gpt_oss", "GptOssCheckpoint", "MXFP4Weight", "reproducing_rules", "MX_RULES",
           "rule_bytes", "reference_orientations", "reference_rows", "matching_orientation", "match_readings",
           "STORED", "TRANSPOSED"]
