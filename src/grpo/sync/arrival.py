"""Did the sync arrive? The served weight version, and a fingerprint of a few served parameters against the trainer's.

`grpo/logprob_diff` (trainer against sampler log-probs on the sampled tokens) cannot prove arrival: a small update
(lr 1e-6 in bf16) moves log-probs far less than the kernel mismatch between vLLM and the trainer, so the figure looks
the same whether the weights arrived or not. This check compares the weights themselves: after a sync the trainer
sums a few parameters (cast to the dtype vLLM serves them in, in float64) and asks every vLLM worker for the same
sums (`grpo_weight_fingerprint` of the worker extension). Equal sums: the trainer's weights are the ones served.

The probes are parameters vLLM keeps unfused under their Hugging Face names: the final norm, and the first and last
blocks' norms, attention output and MLP down projections. Under tensor parallelism the projections are split across
workers (their shard sums add up) and the norms are replicated (worker 0's sum counts). vLLM's CPU backend repacks
linear weights outside their parameters (left empty), so there only the norms are compared.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from grpo.weights.params import is_sharded

log = logging.getLogger(__name__)

# Relative difference of two float64 sums of the same values summed in another order stays many orders below this.
MATCH_TOLERANCE = 1e-9


def probe_names(names: Iterable[str]) -> list[str]:
    """The fingerprinted parameters among `names` (a model's Hugging Face parameter names)."""
    names = list(names)
    blocks = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()})
    wanted = ["model.norm.weight"]
    for i in {blocks[0], blocks[-1]} if blocks else ():
        wanted += [f"model.layers.{i}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm",
                                                             "self_attn.o_proj", "mlp.down_proj")]
    present = set(names)
    return sorted(n for n in wanted if n in present)


def tensor_sum(tensor: torch.Tensor, dtype: Optional[torch.dtype] = None) -> float:
    """Sum of `tensor`'s values after a cast to `dtype` (the served dtype), accumulated in float64."""
    values = tensor.detach()
    if dtype is not None:
        values = values.to(dtype)
    return float(values.double().sum().item())


def served_sums(worker_results: list[Mapping[str, Any]], full_shapes: Mapping[str, list[int]]) -> dict[str, float]:
    """Combine the workers' ``{name: {"shape", "dtype", "sum"}}`` answers into one sum per parameter: a parameter
    whose worker shape is the full shape is replicated (worker 0's sum), otherwise sharded (the shard sums added)."""
    out: dict[str, float] = {}
    for name, shape in full_shapes.items():
        parts = [r[name] for r in worker_results if name in r]
        if not parts:
            continue
        replicated = list(parts[0]["shape"]) == list(shape)
        out[name] = float(parts[0]["sum"]) if replicated else float(sum(p["sum"] for p in parts))
    return out


def compare(expected: Mapping[str, float], served: Mapping[str, float]) -> tuple[bool, float]:
    """(match, largest relative difference) over the parameters both sides report; no common one is no match."""
    common = [n for n in expected if n in served]
    if not common:
        return False, float("inf")
    worst = max(abs(expected[n] - served[n]) / max(abs(expected[n]), 1e-12) for n in common)
    return worst <= MATCH_TOLERANCE, worst


def check_arrival(model: nn.Module, client: Any, version: int, *, fingerprint: bool = True,
                  served: str | None = None) -> dict[str, float]:
    """The served version (of LoRA adapter `served`, when given: a server shared by several jobs counts each
    adapter's own), and (with `fingerprint`, a model not sharded by FSDP2, and the served version at
    `version`) whether the served probe parameters equal the trainer's: ``sync/weights_match`` 1 or 0 and
    ``sync/weights_max_rel_diff``. A mismatch is logged as a warning naming the parameters compared."""
    served_version = client.weight_version(served) if served else client.weight_version()
    out = {"sync/served_version": float(served_version)}
    if not fingerprint or served_version != version or is_sharded(model):
        return out  # e.g. a background reload still in flight: its version is not served yet
    params = dict(model.named_parameters())
    names = probe_names(params)
    if not names:
        return out
    workers = client.rpc("grpo_weight_fingerprint", names=names)
    # A weight vLLM quantized on loading (server.quantization=fp8) holds scaled 8-bit values: its sum says nothing of
    # the trainer's, so only the probes it serves unquantized (the norms) are compared.
    quantized = {n for r in workers for n in r if str(r[n]["dtype"]).startswith("float8")}
    names = [n for n in names if n not in quantized]
    workers = [{n: v for n, v in r.items() if n not in quantized} for r in workers]
    if not names:
        return out
    dtypes = {n: getattr(torch, r[n]["dtype"]) for r in workers for n in r}
    expected = {n: tensor_sum(params[n], dtypes.get(n)) for n in names}
    served = served_sums(workers, {n: list(params[n].shape) for n in names})
    match, worst = compare(expected, served)
    if not match:
        log.warning("weight sync to version %d did not arrive as sent: served sums of %s differ from the trainer's "
                    "(largest relative difference %.3g)", version, ", ".join(names), worst)
    return {**out, "sync/weights_match": float(match), "sync/weights_max_rel_diff": worst}
