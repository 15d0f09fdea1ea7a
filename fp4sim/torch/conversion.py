"""A model's linear layers to QuantLinear and back: :func:`convert` (the keep rules, the output head), :func:`set_recipe`
mid-run, :func:`set_data_parallel_rank`."""
from __future__ import annotations

import fnmatch
import warnings

import torch

from .module import QuantLinear, _quant_layers, _resolve

__all__ = ["convert", "set_recipe", "set_data_parallel_rank", "is_output_head", "HEAD_NAMES"]

HEAD_NAMES = ("lm_head", "output", "head")      # a model's output head, by the last component of its name


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _n_blocks(recipe, names):
    blocks = [recipe.block_of(n) for n in names]
    return max([b for b in blocks if b is not None], default=-1) + 1 or None


def _tied_to_embedding(model, lin) -> bool:
    return any(isinstance(m, torch.nn.Embedding) and m.weight is lin.weight for m in model.modules())


def is_output_head(model, name: str, lin) -> bool:
    """Whether the Linear ``name`` is the model's output head: named ``lm_head``, ``output`` or ``head`` (the last
    component of its name), or its weight is an ``nn.Embedding``'s (tied embeddings)."""
    return name.rpartition(".")[2] in HEAD_NAMES or _tied_to_embedding(model, lin)


def _unmatched(globs, names, what):
    for g in globs:
        if not any(fnmatch.fnmatchcase(n, g) for n in names):
            near = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"{what} {g!r} matches no linear layer of the model (its layers: {near}); give a name "
                             "or glob (fnmatch) of the model's own layer names")


def _refuse_sharded(model):
    """ValueError where FSDP2 (fully_shard) or FSDP1 already wraps the model: convert comes first."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                                                 # a torch without distributed
        return
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) or type(p).__name__ == "FlatParameter":
            raise ValueError(f"convert: parameter {n!r} is already sharded ({type(p).__name__}): call "
                             "fp4sim.torch.convert(model, recipe) before fully_shard / FSDP / DDP, as you would "
                             "any module swap (docs/training.md, 'Training at scale')")


def set_data_parallel_rank(model: torch.nn.Module, rank):
    """Make every QuantLinear of ``model`` draw the stochastic-rounding bits of data-parallel rank ``rank``
    (:func:`fp4sim.emulate.sr_key`): a single process reproduces any rank's draws this way. ``rank=None``
    restores the default, the process's rank in torch.distributed's default group (0 where none is
    initialised). Returns the model."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank={rank!r}: an integer >= 0, or None (torch.distributed's rank)")
    for _, m in _quant_layers(model):
        m._sr_rank = rank
    return model


def convert(model: torch.nn.Module, recipe="nvfp4_paper", keep_high_precision=(), quantize_head: bool = False
            ) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`QuantLinear` sharing its parameters.

    Layers run under the recipe's high-precision recipe (BF16 by default) when they match its ``keep`` globs or
    ``keep_high_precision`` (more globs), lie in its first / last ``keep_first`` / ``keep_last`` blocks, or are
    the output head: a Linear named ``lm_head``, ``output`` or ``head`` (the last part of its name), or one whose
    weight is tied to an ``nn.Embedding``, as the paper, TransformerEngine and torchao keep it. Pass
    ``quantize_head=True`` to quantize the head as well. A glob that matches no layer raises ValueError. Layer
    indices (which key their stochastic rounding) follow the module order. A model converted before is converted
    again: its QuantLinear modules stay (parameters and SR call counts too) and each takes the new recipe, or its
    high-precision recipe where the keep rules say so, for both its forward and its backward GEMMs. Returns the
    model."""
    recipe = _resolve(recipe)
    if isinstance(keep_high_precision, str):
        keep_high_precision = (keep_high_precision,)
    if not isinstance(quantize_head, bool):
        raise TypeError(f"quantize_head={quantize_head!r}: give True or False")
    lins = _linears(model)
    if not lins:
        raise ValueError("the model has no torch.nn.Linear layers to convert")
    _refuse_sharded(model)
    names = [n for n, _ in lins]
    _unmatched(keep_high_precision, names, "keep_high_precision")
    _unmatched(recipe.keep, names, f"recipe {recipe.name!r}: keep glob")
    n_blocks = _n_blocks(recipe, names)
    slow = recipe.general_path_operands() if not recipe.identity else {}
    if slow:
        from ..training import SlowPathWarning
        whys = sorted(set(slow.values()))
        warnings.warn(f"recipe {recipe.name!r}: {', '.join(slow)} take fp4sim's general path ({'; '.join(whys)}); "
                      "the bits are the same, a training step several times slower than the presets' (see "
                      "docs/training.md, 'Speed'). Filter fp4sim.training.SlowPathWarning to silence this",
                      SlowPathWarning, stacklevel=2)
    for i, (name, lin) in enumerate(lins):
        kept = (recipe.keeps(name, n_blocks) or any(fnmatch.fnmatchcase(name, g) for g in keep_high_precision)
                or (not quantize_head and is_output_head(model, name, lin)))
        r = recipe.high_precision_recipe() if kept and not recipe.identity else recipe
        q = lin if isinstance(lin, QuantLinear) else QuantLinear.from_linear(lin, r, i)
        q.recipe = q.recipe_backward = r
        q.layer_index = i
        q._fp4sim_name = name
        q._fp4sim_kept = kept
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    return model


def set_recipe(model: torch.nn.Module, recipe, which: str = "both", include_kept: bool = False):
    """Change the recipe of every QuantLinear mid-run: ``which`` = ``"forward"`` (Fprop), ``"backward"``
    (Dgrad and Wgrad) or ``"both"`` — the paper's late switch to BF16 is ``set_recipe(model, "bf16", which)``.
    Layers kept in high precision by :func:`convert` keep theirs unless ``include_kept``; of the others, those the
    new recipe keeps (its ``keep`` globs, ``keep_first`` / ``keep_last``) take its high-precision recipe. A model
    without QuantLinear layers, or a keep glob that matches none, raises ValueError."""
    recipe = _resolve(recipe)
    if which not in ("forward", "backward", "both"):
        raise ValueError(f"which={which!r}: use 'forward', 'backward' or 'both'")
    mods = _quant_layers(model)
    names = [n for n, _ in mods]
    _unmatched(recipe.keep, names, f"recipe {recipe.name!r}: keep glob")
    n_blocks = _n_blocks(recipe, names)
    high = recipe.high_precision_recipe() if not recipe.identity else recipe
    for name, m in mods:
        if getattr(m, "_fp4sim_kept", False) and not include_kept:
            continue
        r = high if recipe.keeps(name, n_blocks) else recipe
        if which in ("forward", "both"):
            m.recipe = r
        if which in ("backward", "both"):
            m.recipe_backward = r
    return model
