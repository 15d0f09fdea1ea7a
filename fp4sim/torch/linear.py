"""``QuantLinear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run as a :class:`~fp4sim.training.Recipe`
says, on CPU (Numba backend, zero-copy NumPy views of float32 tensors) or any CUDA GPU (CuPy backend through
DLPack, no host round trip).

The bridge lives in modules named for what each holds; this one gathers their names, as ``fp4sim.torch`` does
(where to read what):

=====================  ===========================================================================================
``module``             :class:`QuantLinear` (its recipes and state, eager and compiled forward),
                       :class:`RecipeMismatchWarning`, :func:`drop_extra_state`
``conversion``         :func:`convert`, :func:`set_recipe`, :func:`set_data_parallel_rank`, the output head
``function``           one call's autograd Function (Fprop; Dgrad and Wgrad) and what each pass sets up
``compile_ops``        the torch.compile operators ``fp4sim::qlinear`` and ``fp4sim::qlinear_backward``
``distributed``        the data-parallel rank's SR bits, the ranks' recipe check, the amax maximum over ranks
``nonfinite``          NaN / Inf warnings and errors, deferred on a device; :func:`flush_warnings`
``stats``              :func:`collect_stats`, :func:`wgrad_errors`, :func:`suggest_high_precision`,
                       :func:`rank_high_precision`, :func:`gradient_fidelity`
``streaming``          :func:`gradient_sinks`, :func:`streaming_fidelity`: weight gradients reduced as the
                       backward makes them, in the memory of one layer
``views``              tensors to NumPy / CuPy arrays and back
=====================  ===========================================================================================
"""
from __future__ import annotations

from .conversion import convert, set_data_parallel_rank, set_recipe
from .module import QuantLinear, RecipeMismatchWarning, drop_extra_state
from .nonfinite import flush_warnings
from .stats import collect_stats, gradient_fidelity, rank_high_precision, suggest_high_precision, wgrad_errors
from .streaming import gradient_sinks, streaming_fidelity

__all__ = ["QuantLinear", "convert", "set_recipe", "collect_stats", "suggest_high_precision", "drop_extra_state",
           "gradient_fidelity", "wgrad_errors", "rank_high_precision", "set_data_parallel_rank",
           "RecipeMismatchWarning", "flush_warnings", "gradient_sinks", "streaming_fidelity"]
