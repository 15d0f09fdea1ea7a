"""What a QuantLinear does under torch.distributed: the data-parallel rank whose stochastic-rounding bits it draws,
the recipe fingerprints every rank must share (checked on a layer's first call), and the maximum over the ranks
that delayed and history amaxes record. ``set_data_parallel_rank`` (:mod:`.conversion`) sets the rank of a
model's layers."""
from __future__ import annotations

import torch

from ..training import OPERANDS, Recipe


def _dp_rank(layer) -> int:
    """The data-parallel rank whose stochastic-rounding bits the layer draws (:func:`fp4sim.emulate.sr_key`): the
    one :func:`set_data_parallel_rank` gave it, else the process's rank in torch.distributed's default group
    (0 where none is initialised)."""
    r = layer.__dict__.get("_sr_rank")
    if r is not None:
        return r
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else 0


def _recipe_id(rec: Recipe) -> str:
    """A short fingerprint of a recipe (every field), the same in every process."""
    import hashlib
    return hashlib.sha1(repr(rec).encode()).hexdigest()[:12]


def _check_ranks_agree(layer):
    """On a layer's first call in a torch.distributed run of several processes: every rank runs it with the same
    forward and backward recipes and layer index (one all_gather of a fingerprint); RuntimeError naming the ranks
    that differ. Once per layer and process."""
    layer._ranks_checked = True
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() < 2:
        return
    mine = (_recipe_id(layer.recipe), _recipe_id(layer.recipe_backward), int(layer.layer_index))
    got = [None] * d.get_world_size()
    d.all_gather_object(got, mine)
    if any(g != got[0] for g in got):
        name = getattr(layer, "_fp4sim_name", f"#{layer.layer_index}")
        differ = [i for i, g in enumerate(got) if g != got[0]]
        raise RuntimeError(f"layer {name!r}: ranks {differ} run it with another recipe or layer index than rank 0 "
                           f"({layer.recipe.name!r} here on rank {d.get_rank()}): convert the model with the same "
                           "recipe, seed and layer order on every rank")


def _amax_reducer(layer, device):
    """The maximum over torch.distributed's ranks, for the delayed amaxes of :func:`fp4sim.emulate.held_amax`
    (None in a single process or where the layer has no such operand)."""
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() < 2:
        return None
    if all(getattr(r, op).amax == "current" for r in (layer.recipe, layer.recipe_backward) for op in OPERANDS):
        return None

    def reduce(v):
        t = torch.tensor([v], dtype=torch.float32, device=device)
        d.all_reduce(t, op=d.ReduceOp.MAX)
        return float(t.item())
    return reduce
