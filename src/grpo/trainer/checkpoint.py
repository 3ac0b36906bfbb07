"""Atomic, resumable checkpoints.

Layout of ``<run_dir>/checkpoints/step_XXXXXX/``:

- model weights as a Hugging Face directory (``model.safetensors`` with the model's own unfused parameter names,
  ``config.json``, tokenizer files) that ``transformers.from_pretrained`` and vLLM load directly; for a PEFT model
  the adapter instead (``adapter_model.safetensors`` + ``adapter_config.json``), loadable by PEFT and vLLM LoRA;
- ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` (python, numpy, torch and CUDA generators);
- ``trainer_state.json`` (``step`` plus the caller's ``state``, which must be JSON-serialisable);
- ``COMPLETE``, written last. A directory without it is never used.

Everything is written into a hidden temporary directory beside the final one, fsynced, then renamed into place with
``os.replace``, so a crash leaves either the previous checkpoint set or the new complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from grpo import faults

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (and ``root`` itself) to disk."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished ``tmp`` onto ``final`` (replacing an older one), durably."""
    _fsync_tree(tmp)
    old = None
    if final.exists():
        # os.replace can't overwrite a non-empty directory: move the old one aside first, drop it afterwards.
        old = final.parent / f".old_{final.name}_{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_model(model: nn.Module, tokenizer: Any, out: Path) -> None:
    # save_pretrained writes the module's own (unfused) names; for a PeftModel it writes only the adapter.
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def save_model_weights(model: nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write ``model`` (HF format, or the adapter of a PEFT model) and ``tokenizer`` to ``out_dir`` atomically."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{final.name}_", dir=final.parent))
    try:
        _write_model(model, tokenizer, tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def _read_safetensors(directory: Path, stem: str) -> dict[str, torch.Tensor]:
    """All tensors of ``<stem>.safetensors`` or its sharded ``<stem>-XXXXX-of-XXXXX.safetensors`` files."""
    from safetensors.torch import load_file

    single = directory / f"{stem}.safetensors"
    files = [single] if single.exists() else sorted(directory.glob(f"{stem}-*-of-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {stem}.safetensors in {directory}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def load_model_weights(model: nn.Module, directory: str | Path) -> None:
    """Load weights written by ``save_model_weights`` into ``model`` in place (adapter only for PEFT models)."""
    directory = Path(directory)
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, _read_safetensors(directory, "adapter_model"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter in {directory} has keys the model lacks: {unexpected[:5]}")
        return
    sd = _read_safetensors(directory, "model")
    result = model.load_state_dict(sd, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"checkpoint {directory} has keys the model lacks: {result.unexpected_keys[:5]}")
    # save_pretrained omits tied copies (lm_head tied to the embeddings); anything else missing is an error.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in sd if k in params}
    missing = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded]
    missing = [k for k in missing if k in params]  # buffers (e.g. rotary inv_freq) are rebuilt by the model
    if missing:
        raise RuntimeError(f"checkpoint {directory} lacks parameters: {missing[:5]}")


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
    ) -> Path:
        """Write checkpoint ``step`` atomically, then delete all but the newest ``keep`` complete ones."""
        trainer_state = {"step": int(step), **(state or {})}
        try:
            state_json = json.dumps(trainer_state, indent=2, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"checkpoint state must be JSON-serialisable: {e}") from e
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{final.name}_", dir=self.root))
        try:
            _write_model(model, tokenizer, tmp)
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            if scheduler is not None:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(_rng_state(), tmp / "rng.pt")
            faults.point("checkpoint_write", step)  # test-only: GRPO_FAULT=sigterm@checkpoint_write:<step>
            (tmp / "trainer_state.json").write_text(state_json)
            (tmp / COMPLETE).write_text(f"{step}\n")
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        # Our own files; optimizer states of some optimizers (bitsandbytes) hold non-tensor objects.
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
        if scheduler is not None and (path / "scheduler.pt").exists():
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return json.loads((path / "trainer_state.json").read_text())
