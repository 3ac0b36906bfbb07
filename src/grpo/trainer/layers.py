"""Which transformer blocks train: layer-spec resolution, freezing for full fine-tuning, and LoRA placement."""

from __future__ import annotations

import re
from typing import Any, Optional

from torch import nn

from grpo.schema.model import LoraConfig

# Attribute paths of the block list in common architectures (Llama/Qwen2/Mistral first).
_BLOCK_PATHS = ("model.layers", "model.model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")


def _percent_count(spec: str, pct: int, num_layers: int) -> int:
    if not 1 <= pct <= 100:
        raise ValueError(f"layer spec {spec!r}: percentage must be 1-100 (model has {num_layers} layers)")
    # Same rounding as the reference README (start index int((1 - p) * N)), i.e. ceil(p * N), at least one block.
    return max(1, num_layers - ((100 - pct) * num_layers) // 100)


def resolve_layer_indices(spec: Any, num_layers: int) -> list[int]:
    """Sorted block indices selected by ``spec`` for a model of ``num_layers`` blocks.

    ``all``; ``topN`` = the last N percent of blocks (at least one); ``firstN`` = the first N percent (the bottom
    counterpart of topN, as conf/layers/first50.yaml documents); ``lastN`` = the last N blocks; explicit ranges and
    lists ``"20-31"``, ``"0-3,28-31"``, ``"5"``, or an int. Anything out of range or malformed raises ``ValueError``
    naming the spec and the model's layer count.
    """
    if num_layers < 1:
        raise ValueError(f"model has {num_layers} layers; need at least 1")
    if isinstance(spec, bool):
        raise ValueError(f"layer spec {spec!r} is malformed (model has {num_layers} layers)")
    if isinstance(spec, int):
        spec = str(spec)
    if isinstance(spec, (list, tuple)):
        spec = ",".join(str(s) for s in spec)
    s = str(spec).strip().lower()
    if s == "all":
        return list(range(num_layers))
    m = re.fullmatch(r"(top|first|last)(\d+)", s)
    if m:
        kind, n = m.group(1), int(m.group(2))
        if kind == "last":
            if not 1 <= n <= num_layers:
                raise ValueError(f"layer spec {spec!r}: asks for {n} blocks but the model has {num_layers} layers")
            return list(range(num_layers - n, num_layers))
        count = _percent_count(str(spec), n, num_layers)
        return list(range(num_layers - count, num_layers)) if kind == "top" else list(range(count))
    indices: set[int] = set()
    for part in s.split(","):
        part = part.strip()
        r = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if r:
            lo, hi = int(r.group(1)), int(r.group(2))
        elif re.fullmatch(r"\d+", part):
            lo = hi = int(part)
        else:
            raise ValueError(
                f"layer spec {spec!r} is malformed (part {part!r}); use all, topN, firstN, lastN or ranges like "
                f"'0-3,28-31' (model has {num_layers} layers, valid indices 0-{num_layers - 1})"
            )
        if lo > hi or hi >= num_layers:
            raise ValueError(
                f"layer spec {spec!r}: range {part!r} is out of range; the model has {num_layers} layers "
                f"(valid indices 0-{num_layers - 1})"
            )
        indices.update(range(lo, hi + 1))
    return sorted(indices)


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(dotted path, ModuleList)`` of the transformer blocks (unwraps PEFT models)."""
    for root in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if root is None:
            continue
        for path in _BLOCK_PATHS:
            obj: Any = root
            for attr in path.split("."):
                obj = getattr(obj, attr, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList):
                return path, obj
    # Generic fallback: the longest ModuleList in the model.
    best: Optional[tuple[str, nn.ModuleList]] = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        raise TypeError(f"cannot find the transformer blocks of {type(model).__name__}")
    return best


def freeze_to_layers(model: nn.Module, indices: list[int]) -> int:
    """Full fine-tuning restricted to the blocks in ``indices``; returns the trainable parameter count.

    With every block selected the whole model trains. Otherwise only the selected blocks train: embeddings, the
    final norm and lm_head are frozen too (they are shared by every layer and would move the frozen ones).
    """
    _, blocks = find_blocks(model)
    n = len(blocks)
    bad = [i for i in indices if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} are out of range; the model has {n} layers")
    if sorted(set(indices)) == list(range(n)):
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        for i in set(indices):
            for p in blocks[i].parameters():
                p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_lora(model: nn.Module, lora_cfg: LoraConfig, indices: list[int], num_layers: Optional[int] = None):
    """Wrap ``model`` in a PEFT LoRA ``PeftModel`` (task CAUSAL_LM) on ``lora_cfg.target_modules``.

    ``lora_cfg`` has ``r``, ``alpha``, ``dropout``, ``target_modules``. When ``indices`` is not every block,
    adapters go only on those blocks (``layers_to_transform``). ``num_layers`` defaults to the model's block count.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    path, blocks = find_blocks(model)
    n = num_layers if num_layers is not None else len(blocks)
    bad = [i for i in indices if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} are out of range; the model has {n} layers")
    get = lora_cfg.get if hasattr(lora_cfg, "get") else lambda k, d=None: getattr(lora_cfg, k, d)
    subset = sorted(set(indices)) != list(range(n))
    config = LoraConfig(
        r=int(get("r", 16)),
        lora_alpha=int(get("alpha", get("lora_alpha", 32))),
        lora_dropout=float(get("dropout", get("lora_dropout", 0.0))),
        target_modules=list(get("target_modules")),
        layers_to_transform=sorted(set(indices)) if subset else None,
        # Tell PEFT the block list's name so layers_to_transform matches e.g. "layers" or "h".
        layers_pattern=path.split(".")[-1] if subset else None,
        task_type=TaskType.CAUSAL_LM,
    )
    return get_peft_model(model, config)
