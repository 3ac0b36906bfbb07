"""Hugging Face weight directories, written atomically and durably, and read back into a model.

A directory is written into a hidden temporary sibling, fsynced, then renamed into place with ``os.replace``, so a
crash leaves either the previous directory or the new complete one. Checkpoints (grpo.trainer.checkpoint) and the
file-based sync modes (grpo.sync) both publish weights this way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

# How a safetensors (Rust) write names the OS error it met: "I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class WeightsWriteError(OSError):
    """A weights directory could not be written (a full disk, an unwritable directory); nothing was published."""

    def __init__(self, final: Path, error: OSError) -> None:
        super().__init__(error.errno, f"could not write weights to {final}: {error}")


def os_error_of(error: BaseException) -> Optional[OSError]:
    """The operating-system error behind a failed write, or None when there is none: `error` itself, one it was
    raised from or while handling, or the one a safetensors write reports only in its message. (torch.save to a path
    reports a full disk as a RuntimeError of its zip writer with no OS error at all; `save_torch` keeps it.)"""
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        m = _RUST_OS_ERROR.search(str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, f"{os.strerror(code)} ({type(e).__name__}: {e})")
        e = e.__cause__ or e.__context__
    return None


def save_torch(obj: Any, path: Path) -> None:
    """torch.save through a Python file, so a failed write raises (or chains) the OSError itself (e.g. ENOSPC)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def is_peft(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (its weights are saved and loaded as an adapter). Only peft builds one, so
    without peft imported there is none: a plain model's run never imports peft (seconds: peft imports
    bitsandbytes, whose CPU ops call torch.compile at import)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry to disk (so a rename inside it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (and ``root`` itself) to disk."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def publish_dir(tmp: Path, final: Path, durable: bool = True) -> None:
    """Rename a finished ``tmp`` onto ``final`` (replacing an older one); ``durable``: flushed to disk first and after,
    so the rename survives a crash."""
    if durable:
        fsync_tree(tmp)
    old = None
    if final.exists():
        # os.replace can't overwrite a non-empty directory: move the old one aside first, drop it afterwards.
        old = final.parent / f".old_{final.name}_{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def drop_tied_copies(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without the second name of a tied parameter (lm_head tied to the embeddings).

    A gathered full state dict holds a separate copy under each name, so save_pretrained cannot see the tie the way
    it does for the module's own shared tensors; dropping the copies keeps the files what a single process writes.
    """
    seen: set[int] = set()
    drop = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            drop.add(name)
        seen.add(id(p))
    return {k: v for k, v in state_dict.items() if k not in drop}


@contextmanager
def quiet_progress_bars():
    """Hugging Face's own progress bars off for the block ("Writing model shards" on every save would print one bar
    per sync and checkpoint under the run's single progress bar); restored afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def write_model(model: nn.Module, tokenizer: Any, out: Path, state_dict: dict | None = None) -> None:
    """``save_pretrained`` into ``out`` (not atomic; see save_model_weights)."""
    # save_pretrained writes the module's own (unfused) names; for a PeftModel it writes only the adapter.
    # `state_dict`: full tensors gathered from an FSDP2 model (its own are shards), written under the same names.
    if state_dict is not None:
        state_dict = drop_tied_copies(model, state_dict)
    with quiet_progress_bars():
        model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def save_model_weights(
    model: nn.Module, tokenizer: Any, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
    durable: bool = True,
) -> Path:
    """Write ``model`` (HF format, or the adapter of a PEFT model) and ``tokenizer`` to ``out_dir`` atomically.
    ``state_dict``: the full tensors to write instead of the module's own (an FSDP2 model's gathered weights).
    ``durable=False`` skips the fsyncs: for weights written only to be served next (a sync writes them again from the
    trainer's own, and a checkpoint holds its own durable copy), 4 of the 11 ms a sync's save took on CPU."""
    final = Path(out_dir)
    try:  # an unwritable parent is the same WeightsWriteError as a failed write into it
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{final.name}_", dir=final.parent))
    except OSError as e:
        raise WeightsWriteError(final, e) from e
    try:
        write_model(model, tokenizer, tmp, state_dict)
        publish_dir(tmp, final, durable)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = os_error_of(e)
        if os_error is None:
            raise
        raise WeightsWriteError(final, os_error) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_safetensors(directory: Path, stem: str) -> dict[str, torch.Tensor]:
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


def safetensors_problem(path: Path) -> Optional[str]:
    """Why the safetensors file `path` cannot be read whole (None when its header parses and its length is what the
    header says): a file cut short (a copy or a disk that ran out) passes a name check and fails only inside vLLM's
    start-up or the loader, with a message about an unterminated JSON string."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 <= n <= size - 8 else None
    except (OSError, ValueError) as e:
        return f"{path.name}: unreadable header ({e})"
    if not isinstance(header, dict):
        return f"{path.name}: cut short ({size} bytes, not even its header)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and len(t.get("data_offsets", ())) == 2]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{path.name}: {size} bytes where its header says {expected} (cut short)" if size < expected else (
            f"{path.name}: {size} bytes where its header says {expected}")
    return None


def adapter_by_param_name(model: nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved PEFT adapter (``adapter_model.safetensors``) keyed by ``model``'s own parameter names, the form
    torch.distributed's ``set_model_state_dict`` takes: PEFT writes each trainable parameter's name without the
    adapter's (``.lora_A.default.weight`` -> ``.lora_A.weight``). Keys the model lacks raise."""
    adapter = getattr(model, "active_adapter", "default")
    names = {n.replace(f".{adapter}", ""): n for n, p in model.named_parameters() if p.requires_grad}
    unexpected = [k for k in saved if k not in names]
    if unexpected:
        raise RuntimeError(f"the adapter has keys the model lacks: {unexpected[:5]}")
    return {names[k]: v for k, v in saved.items()}


def load_model_weights(model: nn.Module, directory: str | Path) -> None:
    """Load weights written by ``save_model_weights`` into ``model`` in place (adapter only for PEFT models)."""
    directory = Path(directory)
    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, read_safetensors(directory, "adapter_model"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter in {directory} has keys the model lacks: {unexpected[:5]}")
        return
    sd = read_safetensors(directory, "model")
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
