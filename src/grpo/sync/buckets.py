"""Packing named tensors into flat byte buckets for a broadcast, and unpacking them again.

Pure functions (no process groups, no devices beyond the tensors' own), so they are tested on CPU.

A bucket is one flat `uint8` buffer holding whole tensors back to back, in the order given, with no padding, plus
the metadata to cut it up again: `(name, dtype, shape, offset, nbytes)` per tensor. Buckets hold at most
`bucket_bytes` bytes, except that a tensor bigger than `bucket_bytes` gets a bucket of its own; a tensor whose
offset would not be a multiple of its element size starts a new bucket (never the case for a model of one dtype).

The layout is byte-for-byte vLLM's packed weight-transfer format (`vllm.distributed.weight_transfer.
packed_tensor.unpack_tensor` splits a buffer by the tensors' byte sizes in order), and a bucket is one complete
chunk of vLLM's packed consumer when that consumer's buffer size is `bucket_bytes` and it is handed one bucket's
metadata per `update_weights` call: vLLM closes a chunk only once it *exceeds* its buffer size, so a bucket of at
most `bucket_bytes` (or a single oversized tensor) is received as exactly one broadcast of `nbytes` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in its bucket."""

    name: str
    dtype: str  # torch dtype name without "torch." (vLLM reads it back with getattr(torch, dtype))
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass
class Bucket:
    """Metadata of one flat buffer: its tensors, in order, and its total size."""

    metas: list[TensorMeta] = field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def update_info(self) -> dict:
        """The per-chunk fields of vLLM's `NCCLWeightTransferUpdateInfo` (names, dtype_names, shapes)."""
        return {
            "names": [m.name for m in self.metas],
            "dtype_names": [m.dtype for m in self.metas],
            "shapes": [list(m.shape) for m in self.metas],
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


def tensor_nbytes(dtype: torch.dtype | str, shape: Sequence[int]) -> int:
    dt = to_dtype(dtype) if isinstance(dtype, str) else dtype
    return math.prod(shape) * dt.itemsize


def plan_buckets(specs: Iterable[tuple[str, torch.dtype | str, Sequence[int]]], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving split of `(name, dtype, shape)` specs into buckets of at most `bucket_bytes` bytes;
    a tensor larger than `bucket_bytes` gets its own bucket, one that would sit at an offset not aligned to its
    element size starts a new one. Empty tensors are kept (0 bytes)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    cur = Bucket()
    seen: set[str] = set()
    for name, dtype, shape in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} listed twice")
        seen.add(name)
        dname = dtype if isinstance(dtype, str) else dtype_name(dtype)
        n = tensor_nbytes(dname, shape)
        itemsize = to_dtype(dname).itemsize
        # A new bucket also when the offset would not be a multiple of the element size: vLLM's unpacker views
        # each slice as its dtype in place, which needs an aligned offset (mixed dtypes, odd element counts).
        if cur.metas and (cur.nbytes + n > bucket_bytes or cur.nbytes % itemsize):
            buckets.append(cur)
            cur = Bucket()
        cur.metas.append(TensorMeta(name, dname, tuple(int(s) for s in shape), cur.nbytes, n))
        cur.nbytes += n
        if n > bucket_bytes:  # oversized: alone in its bucket
            buckets.append(cur)
            cur = Bucket()
    if cur.metas:
        buckets.append(cur)
    return buckets


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                device: torch.device | str | None = None) -> torch.Tensor:
    """One flat uint8 buffer with `tensors` (a list in the bucket's order, or a name -> tensor mapping) laid out
    as `bucket` says. Each tensor is cast to its meta's dtype when it differs; shapes must match."""
    if isinstance(tensors, Mapping):
        tensors = [tensors[m.name] for m in bucket.metas]
    if len(tensors) != len(bucket.metas):
        raise ValueError(f"bucket has {len(bucket.metas)} tensors, got {len(tensors)}")
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    parts = []
    for meta, t in zip(bucket.metas, tensors):
        if tuple(t.shape) != meta.shape:
            raise ValueError(f"{meta.name}: shape {tuple(t.shape)} != planned {meta.shape}")
        want = to_dtype(meta.dtype)
        if t.dtype != want:
            t = t.to(want)
        parts.append(_as_bytes(t.to(device, non_blocking=True)))
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    assert buf.numel() == bucket.nbytes, (buf.numel(), bucket.nbytes)
    return buf


def unpack_bucket(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs cut from `buffer` (views where the offset is aligned to the dtype, copies
    otherwise)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("buffer must be a flat uint8 tensor")
    if buffer.numel() != bucket.nbytes:
        raise ValueError(f"buffer has {buffer.numel()} bytes, bucket needs {bucket.nbytes}")
    out = []
    for m in bucket.metas:
        dt = to_dtype(m.dtype)
        raw = buffer[m.offset : m.offset + m.nbytes]
        if m.offset % dt.itemsize:
            raw = raw.clone()  # a view of another dtype needs an aligned offset
        out.append((m.name, raw.view(dt).view(m.shape) if m.nbytes else torch.empty(m.shape, dtype=dt)))
    return out


def pack(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[tuple[torch.Tensor, Bucket]]:
    """Plan and pack in one go (tests, small models): `[(buffer, bucket), ...]`."""
    named = list(named)
    buckets = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in named), bucket_bytes)
    by_name = dict(named)
    return [(pack_bucket(b, [by_name[n] for n in b.names]), b) for b in buckets]
