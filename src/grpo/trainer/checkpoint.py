"""Atomic, resumable checkpoints.

Layout of ``<run_dir>/checkpoints/step_XXXXXX/``:

- model weights as a Hugging Face directory (``model.safetensors`` with the model's own unfused parameter names,
  ``config.json``, tokenizer files) that ``transformers.from_pretrained`` and vLLM load directly; for a PEFT model
  the adapter instead (``adapter_model.safetensors`` + ``adapter_config.json``), loadable by PEFT and vLLM LoRA;
- ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` (python, numpy, torch and CUDA generators);
- FSDP2 runs (torchrun, ``save_distributed``): the same files, written by rank 0 from full state dicts every rank
  helped gather; ``optimizer.pt`` is then keyed by parameter name (``get_optimizer_state_dict``'s full form, which
  either kind of run loads) and ``rng_ranks.pt`` holds every rank's generators;
- ``trainer_state.json`` (``step`` plus the caller's ``state``, which must be JSON-serialisable);
- ``COMPLETE``, written last. A directory without it is never used.

Everything is written into a hidden temporary directory beside the final one, fsynced, then renamed into place with
``os.replace``, so a crash leaves either the previous checkpoint set or the new complete one.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from grpo import faults
from grpo.trainer import fsdp
from grpo.weights import params
from grpo.weights.hf_dir import (
    adapter_by_param_name,
    is_peft,
    load_model_weights,
    os_error_of,
    publish_dir,
    read_safetensors,
    safetensors_problem,
    save_model_weights,
    save_torch,
    write_model,
)

__all__ = ["COMPLETE", "CheckpointManager", "CheckpointWriteError", "load_model_weights", "save_model_weights"]

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def read_trainer_state(checkpoint: Path) -> dict:
    """A checkpoint's ``trainer_state.json``: ``step`` and the state its saver added (e.g. ``weight_version``)."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """What makes a complete checkpoint (``COMPLETE`` written) unusable: a file it needs that is missing or cut short
    (a run dir copied in part, a file deleted to save space, a damaged disk). Reads headers and zip directories
    only; an empty list when the checkpoint looks whole."""
    checkpoint = Path(checkpoint)
    problems = []
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        problems.append("no model.safetensors or adapter_model.safetensors")
    problems += [p for p in map(safetensors_problem, weights) if p is not None]
    for index in checkpoint.glob("*.safetensors.index.json"):  # a model saved in shards names each of them
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            problems.append(f"{index.name}: unreadable ({type(e).__name__}: {e})")
            continue
        problems += [f"no {name} (named in {index.name})" for name in sorted(shards)
                     if not (checkpoint / name).exists()]
    for name in ("optimizer.pt", "rng.pt", "scheduler.pt"):
        path = checkpoint / name
        if not path.exists():
            if name != "scheduler.pt":  # optional: load() skips a missing one
                problems.append(f"no {name}")
        elif not zipfile.is_zipfile(path):  # torch.save writes a zip, whose directory is at the end
            problems.append(f"{name}: not a whole torch file ({path.stat().st_size} bytes; cut short?)")
    try:
        read_trainer_state(checkpoint)["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"trainer_state.json: unreadable ({type(e).__name__}: {e})")
    return problems


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, unwritable or missing directory); the previous checkpoints
    are untouched."""

    def __init__(self, step: int, root: Path, error: OSError) -> None:
        super().__init__(error.errno, f"could not write checkpoint step {step} under {root}: {error}")
        self.step = step


class CheckpointManager:
    """Saves, finds and restores checkpoints under ``<run_dir>/checkpoints``, keeping the newest ``keep``."""

    def __init__(self, run_dir: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def _complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / COMPLETE).exists():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return [p for _, p in self._complete()]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, or None (directories without ``COMPLETE`` are ignored)."""
        ckpts = self._complete()
        return ckpts[-1][1] if ckpts else None

    def save(
        self,
        step: int,
        model: nn.Module,
        tokenizer: Any,
        optimizer: Optional[torch.optim.Optimizer],
        scheduler: Any,
        state: Optional[dict] = None,
        *,
        model_state: Optional[dict[str, torch.Tensor]] = None,
        optimizer_state: Optional[dict] = None,
        rng_states: Optional[list[dict]] = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically, then delete all but the newest ``keep`` complete ones.

        ``model_state`` / ``optimizer_state``: full state dicts written instead of ``model``'s and ``optimizer``'s
        own (an FSDP2 run's, gathered on rank 0); ``rng_states``: every rank's generators, rank 0 first (only
        rank 0's go to ``rng.pt``). ``save_distributed`` passes them."""
        trainer_state = {"step": int(step), **(state or {})}
        try:
            state_json = json.dumps(trainer_state, indent=2, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"checkpoint state must be JSON-serialisable: {e}") from e
        final = self.root / f"step_{step:06d}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{final.name}_", dir=self.root))
        except OSError as e:
            raise CheckpointWriteError(step, self.root, e) from e
        try:
            write_model(model, tokenizer, tmp, model_state)
            if optimizer_state is not None:
                save_torch(optimizer_state, tmp / "optimizer.pt")
            elif optimizer is not None:
                save_torch(optimizer.state_dict(), tmp / "optimizer.pt")
            if scheduler is not None:
                save_torch(scheduler.state_dict(), tmp / "scheduler.pt")
            save_torch(rng_states[0] if rng_states else _rng_state(), tmp / "rng.pt")
            if rng_states and len(rng_states) > 1:
                save_torch(rng_states, tmp / "rng_ranks.pt")
            faults.point("checkpoint_write", step)  # test-only: GRPO_FAULT=sigterm@checkpoint_write:<step>
            (tmp / "trainer_state.json").write_text(state_json)
            (tmp / COMPLETE).write_text(f"{step}\n")
            publish_dir(tmp, final)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # A full disk reaches here as an OSError, a safetensors error naming it, or (torch) a chained OSError.
            os_error = os_error_of(e)
            if os_error is None:
                raise
            raise CheckpointWriteError(step, self.root, os_error) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        faults.point("checkpoint_published", step)  # test-only: the new checkpoint is in place, pruning not done
        self._prune()
        return final

    def _prune(self) -> None:
        for _, p in self._complete()[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        # Leftovers of saves that crashed before their rename (this process's own save already finished).
        for p in self.root.glob(".tmp_step_*"):
            shutil.rmtree(p, ignore_errors=True)

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
    ) -> dict:
        """Restore model weights (the adapter for PEFT models), optimizer, scheduler and RNG from ``path``;
        return the trainer state (``step`` plus what was passed as ``state``)."""
        path = Path(path)
        if not (path / COMPLETE).exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        load_model_weights(model, path)
        settings = optimizer_settings(optimizer) if optimizer is not None else []
        # Our own files; optimizer states of some optimizers (bitsandbytes) hold non-tensor objects.
        if optimizer is not None:
            optim_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
            if _keyed_by_name(optim_state):  # written by an FSDP2 run (save_distributed)
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
            else:
                optimizer.load_state_dict(optim_state)
        scheduler_state = None
        if scheduler is not None and (path / "scheduler.pt").exists():
            scheduler_state = torch.load(path / "scheduler.pt", weights_only=False)
        if optimizer is not None:
            keep_optimizer_settings(optimizer, settings, scheduler_state, path)
        if scheduler_state is not None:
            scheduler.load_state_dict(scheduler_state)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return read_trainer_state(path)

    # ------------------------------------------------------------------ FSDP2 (torchrun)
    def save_distributed(
        self,
        step: int,
        model: nn.Module,
        tokenizer: Any,
        optimizer: Optional[torch.optim.Optimizer],
        scheduler: Any,
        state: Optional[dict] = None,
    ) -> Optional[Path]:
        """``save`` for an FSDP2 model; every rank must call it. All ranks join the gathers of the full model and
        optimizer state (onto rank 0's CPU), rank 0 alone writes them in ``save``'s format, atomically, and prunes;
        it returns the checkpoint there and None elsewhere. It ends with a collective that carries rank 0's outcome,
        so no rank runs ahead of a checkpoint being written and a failed write raises on every rank."""
        model_state, optimizer_state = params.full_state_dicts(model, optimizer)
        rng_states = fsdp.gather_object(_rng_state())
        path, error = None, None
        if fsdp.is_rank0():
            try:
                path = self.save(step, model, tokenizer, optimizer, scheduler, state, model_state=model_state,
                                 optimizer_state=optimizer_state, rng_states=rng_states)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks have heard of it
                error = e
        failed = fsdp.broadcast_object(None if error is None else repr(error))
        if error is not None:
            raise error
        if failed is not None:
            raise RuntimeError(f"rank 0 could not write checkpoint step {step}: {failed}")
        return path

    def load_distributed(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
    ) -> dict:
        """``load`` for an FSDP2 model; every rank must call it. Rank 0 reads the checkpoint (of an FSDP2 run or of
        a single process); the weights and optimizer state reach every rank's shards by broadcast
        (``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``broadcast_from_rank0``), scheduler, RNG
        (each rank its own when the world size matches, else rank 0's) and trainer state by ``broadcast_object``.
        Only rank 0 needs to see ``path``. Returns the trainer state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(path)
        model_state: dict = {}
        optimizer_state: dict = {}
        small: Optional[dict] = None
        error: Optional[BaseException] = None
        if fsdp.is_rank0():
            try:
                model_state, optimizer_state, small = _read_checkpoint(path, model, optimizer, scheduler)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks have heard of it
                error = e
        # The small files, or rank 0's error, before any rank enters the weight broadcasts.
        small = fsdp.broadcast_object(small if error is None else repr(error))
        if error is not None:
            raise error
        if not isinstance(small, dict):
            raise RuntimeError(f"rank 0 could not read checkpoint {path}: {small}")
        # strict=False: the files omit tied copies (lm_head); _check_covers checked every parameter is there.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, model_state, options=options)
        if optimizer is not None:
            settings = optimizer_settings(optimizer)
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
            keep_optimizer_settings(optimizer, settings, small["scheduler"], path)
        if scheduler is not None and small["scheduler"] is not None:
            scheduler.load_state_dict(small["scheduler"])
        rng = small["rng"]
        if isinstance(rng, list):
            rng = rng[fsdp.rank()] if len(rng) == fsdp.world_size() else rng[0]
        _set_rng_state(rng)
        return small["state"]


def _read_checkpoint(
    path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], scheduler: Any
) -> tuple[dict, dict, dict]:
    """Rank 0's read of a checkpoint for load_distributed: full model state, optimizer state keyed by name, and the
    small parts (trainer state, scheduler, RNG) that every rank receives by broadcast."""
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    # A LoRA run's checkpoint holds the adapter alone (the base is the initial model, loaded before).
    model_state = (adapter_by_param_name(model, read_safetensors(path, "adapter_model")) if is_peft(model)
                   else read_safetensors(path, "model"))
    _check_covers(model, model_state, path)
    optimizer_state: dict = {}
    if optimizer is not None:
        optimizer_state = _by_name(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False), model,
                                   optimizer)
    rng_ranks = path / "rng_ranks.pt"
    small = {
        "state": read_trainer_state(path),
        "scheduler": torch.load(path / "scheduler.pt", weights_only=False)
        if scheduler is not None and (path / "scheduler.pt").exists() else None,
        "rng": torch.load(rng_ranks if rng_ranks.exists() else path / "rng.pt", weights_only=False),
    }
    return model_state, optimizer_state, small


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters as this run built them from its config (lr, betas, weight decay, ...;
    `initial_lr`: the schedule's peak), without the parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _same_setting(a: Any, b: Any) -> bool:
    """Equal hyperparameters, a list and a tuple of the same values included: torch.distributed's
    set_optimizer_state_dict gives back the checkpoint's betas as a list, the optimizer was built with a tuple."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    return a == b


def keep_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]],
                            scheduler_state: Optional[dict], path: Path) -> None:
    """After a checkpoint's optimizer state is loaded: put back this run's `settings` (`optimizer_settings` before
    the load). ``Optimizer.load_state_dict`` restores the checkpoint's hyperparameters with its moments, so a resume
    with another optimizer.lr (or weight decay, betas) trained on the old ones while it logged the new. The moments
    and step counts stay the checkpoint's; the learning rate keeps its point on the schedule, at the new peak
    (`scheduler_state`, the checkpoint's LambdaLR state, is changed to match before it is loaded). Logs a change."""
    changed = set()
    for i, (group, mine) in enumerate(zip(optimizer.param_groups, settings)):
        for key, value in mine.items():
            if key not in ("lr", "initial_lr"):
                if not _same_setting(group.get(key), value):
                    changed.add(f"{key} {group.get(key)} -> {value}")
                group[key] = value
        peak_key = "initial_lr" if "initial_lr" in mine else "lr"  # the schedule's peak, or the rate itself
        old_peak, new_peak = group.get(peak_key, group["lr"]), mine[peak_key]
        if old_peak == new_peak:
            continue
        changed.add(f"lr {old_peak} -> {new_peak}")
        group["lr"] = group["lr"] * new_peak / old_peak if old_peak else mine["lr"]
        group[peak_key] = new_peak
        if scheduler_state is not None:
            scheduler_state["base_lrs"][i] = new_peak
            scheduler_state["_last_lr"][i] = group["lr"]
    if changed:
        log.warning("resumed from %s with this run's optimizer settings, not the checkpoint's: %s (its moments carry "
                    "over)", path, "; ".join(sorted(changed)))


def _keyed_by_name(optimizer_state: dict) -> bool:
    """True for a full optimizer state dict keyed by parameter name (``get_optimizer_state_dict``)."""
    params = [p for g in optimizer_state.get("param_groups", []) for p in g["params"]]
    return bool(params) and all(isinstance(p, str) for p in params)


def _by_name(optimizer_state: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer_state`` keyed by parameter name, the form ``set_optimizer_state_dict`` takes. torch's own
    ``Optimizer.state_dict()`` numbers the parameters in param_groups order; this optimizer, built the same way,
    names them (the assumption ``Optimizer.load_state_dict`` makes too)."""
    if _keyed_by_name(optimizer_state):
        return optimizer_state
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in optimizer_state["param_groups"] for i in g["params"]]
    if len(saved) != len(order):
        raise RuntimeError(f"optimizer state has {len(saved)} parameters, this optimizer {len(order)}")
    return {
        "state": {order[i]: v for i, v in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optimizer_state["param_groups"]],
    }


def _check_covers(model: nn.Module, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Every parameter of ``model`` (tied ones once; of a PEFT model the adapter's) in ``state_dict``, and no key the
    model lacks."""
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
    unexpected = [k for k in state_dict if k not in known]
    if unexpected:
        raise RuntimeError(f"checkpoint {path} has keys the model lacks: {unexpected[:5]}")
    adapter_only = is_peft(model)
    missing = [n for n, p in model.named_parameters() if n not in state_dict and (p.requires_grad or not adapter_only)]
    if missing:
        raise RuntimeError(f"checkpoint {path} lacks parameters: {missing[:5]}")
