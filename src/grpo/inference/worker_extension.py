"""Methods added to every vLLM worker (``--worker-extension-cls grpo.inference.worker_extension.WeightSyncExtension``).

vLLM mixes this class into its worker class, so `self` is the worker (`self.model_runner`, `self.device`,
`self.reload_weights` ...). The API server reaches these methods with `engine_client.collective_rpc(name)`; our
server exposes the `grpo_*` ones at ``POST /grpo/rpc``. Results travel through vLLM's msgpack IPC, so they are
plain JSON-able values (bytes as base64 text).
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Any


class WeightSyncExtension:
    """Weight-sync helpers that run inside each vLLM worker process."""

    def _grpo_model(self):
        return self.model_runner.get_model()

    def grpo_param_info(self) -> list[dict[str, Any]]:
        """Name, shape, dtype and device of every parameter of the served model (vLLM's names, fused layout)."""
        return [
            {"name": n, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device)}
            for n, p in self._grpo_model().named_parameters()
        ]

    def grpo_reload_weights(self, path: str) -> float:
        """Reload HF-format weights from `path` in place (vLLM's layer-wise reload); returns seconds taken."""
        t0 = time.perf_counter()
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        self._grpo_refresh_tied_head()
        return time.perf_counter() - t0

    def _grpo_refresh_tied_head(self) -> None:
        # With tied embeddings the checkpoint has no lm_head.weight, so vLLM's layer-wise reload "fails" the
        # lm_head layer and puts its old kernel tensors back. The weight itself is shared with embed_tokens and
        # does hold the new values, but on CPU the head's GEMM reads a oneDNN copy packed at load time: re-run
        # the head's post-load processing so logits use the new embedding (a no-op for unquantized CUDA heads).
        model = self._grpo_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or getattr(head, "weight", None) is None:
            return
        if head.weight.data_ptr() != embed.weight.data_ptr():
            return  # untied: the checkpoint's lm_head.weight was reloaded with everything else
        quant_method = getattr(head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(head)

    def grpo_receive_buckets(self, buckets: list[dict[str, Any]]) -> float:
        """mode.receive=direct: receive each bucket of the trainer's broadcast (on the NCCL group vLLM's
        weight-transfer engine joined) into a buffer this worker keeps, and load its tensors with the model's
        `load_weights`, which copies them into the served tensors (storage kept, so CUDA graphs stay valid).
        Skips the engine's per-sync layer-wise reload; the buckets' layout is vLLM's packed one
        (grpo.sync.buckets). Returns seconds taken."""
        import math

        import torch
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        t0 = time.perf_counter()
        group = self.weight_transfer_engine.model_update_group
        if group is None:
            raise RuntimeError("mode.receive=direct: the weight-transfer group is not initialised")
        model = self._grpo_model()
        stream = torch.cuda.current_stream()
        for bucket in buckets:
            dtypes = [getattr(torch, name) for name in bucket["dtype_names"]]
            sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(bucket["shapes"], dtypes)]
            buf = self._grpo_receive_buffer(sum(sizes))
            group.broadcast(buf, src=0, stream=stream)
            # The copies run on this stream before the next bucket's receive overwrites the buffer.
            model.load_weights(unpack_tensor(buf, list(bucket["names"]), bucket["shapes"], dtypes, sizes))
        stream.synchronize()
        return time.perf_counter() - t0

    def _grpo_receive_buffer(self, nbytes: int):
        """A uint8 view of `nbytes` on a buffer kept across syncs (grown when a bucket needs more)."""
        import torch

        buf = getattr(self, "_grpo_buffer", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._grpo_buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def grpo_empty_cache(self) -> None:
        """Release the CUDA caching allocator's unused blocks (after a weight transfer's receive buffers)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def grpo_param_checksum(self) -> float:
        """Sum of |w| over all parameters: a cheap way to see that weights changed."""
        return float(sum(p.detach().float().abs().sum().item() for p in self._grpo_model().parameters()))

    def grpo_weight_fingerprint(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Shape, dtype and float64 sum of each named parameter this worker holds (its shard under tensor parallel);
        names it does not hold (fused or renamed by vLLM) or holds empty (the CPU backend repacks linear weights
        elsewhere) are left out (grpo.sync.arrival)."""
        params = dict(self._grpo_model().named_parameters())
        return {
            n: {"shape": list(params[n].shape), "dtype": str(params[n].dtype).removeprefix("torch."),
                "sum": float(params[n].detach().double().sum().item())}
            for n in names if n in params and params[n].numel() > 0
        }  # fmt: skip

    def grpo_share_cpu_params(self, path: str, create: bool) -> dict[str, Any]:
        """Move every parameter into one shared file mapping at `path`, so another process on this host can map the
        same memory (mode=shared_vllm on CPU). `create`: make the file and copy the loaded weights into it; else
        adopt an existing file of the same layout as it is (a restarted server taking up the trainer's weights).

        Returns ``{"path", "size", "params": {name: {"offset", "shape", "dtype"}}}`` (vLLM's names, fused layout,
        byte offsets 64-aligned). Needs the plain CPU GEMMs of grpo.inference.vllm_plugin: vLLM's packed GEMMs
        drop the weight parameters after loading and would never read the shared memory.
        """
        import os

        import torch

        params = list(self._grpo_model().named_parameters())
        not_cpu = [n for n, p in params if p.device.type != "cpu"]
        if not_cpu:
            raise RuntimeError(f"parameters {not_cpu[:3]} are not on the CPU; shared CPU memory needs vLLM's CPU backend")
        dropped = [n for n, p in params if p.numel() == 0]
        if dropped:
            raise RuntimeError(
                f"vLLM dropped the weights of {dropped[:3]} after packing them for its CPU GEMMs: start the server "
                "with GRPO_VLLM_CPU_PLAIN_GEMM=1 (mode=shared_vllm's launcher does) so its GEMMs read the parameters"
            )
        layout, size = {}, 0
        for name, p in params:
            size = -(-size // 64) * 64
            layout[name] = {"offset": size, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            size += p.numel() * p.element_size()
        if not create and os.path.getsize(path) != size:
            raise RuntimeError(f"{path} holds {os.path.getsize(path)} bytes, this model's parameters {size}")
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for name, p in params:
            start = layout[name]["offset"]
            view = flat[start : start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            if create:
                view.copy_(p.data)
            p.data = view  # the Parameter object stays (its loaders and the layers' references keep working)
        return {"path": path, "size": size, "params": layout}

    def grpo_export_ipc_handles(self) -> str:
        """CUDA IPC handles of every parameter, pickled and base64-encoded.

        Each entry is ``name -> (rebuild_fn_args, shape, dtype)``, where the args feed
        `torch.multiprocessing.reductions.rebuild_cuda_tensor` in another process on the same host. The tensors
        are vLLM's own storage: writes through them change what vLLM serves. CUDA only, because vLLM's CPU
        backend repacks weights for oneDNN at load time and its kernels never read the original tensors.
        """
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        out: dict[str, Any] = {}
        for name, p in self._grpo_model().named_parameters():
            if p.device.type != "cuda":
                raise RuntimeError(
                    f"parameter {name} lives on {p.device}; CUDA IPC sharing needs a CUDA vLLM worker"
                )
            _rebuild, args = reduce_tensor(p.data)
            out[name] = {"args": args, "shape": tuple(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
        torch.cuda.synchronize()
        return base64.b64encode(pickle.dumps(out)).decode()
