"""Server side of mode=broadcast: vLLM's own NCCL weight-transfer engine, driven from our middleware.

vLLM (0.26 and 0.32 alike) exposes the engine on its engine client: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights` (one chunk per call), `finish_weight_update`; the server must run with
``--weight-transfer-config '{"backend": "nccl"}'``. vLLM's own HTTP routes for these moved between versions
(`serve/dev/rlhf` behind VLLM_SERVER_DEV_MODE in 0.26, `entrypoints/rl` in 0.32), so our middleware serves two
stable routes instead:

- ``POST /grpo/weight_transfer/init`` {master_address, master_port, world_size, rank_offset, bucket_bytes,
  num_buffers}: every worker joins the trainer's NCCL group (blocks until the trainer joins too).
- ``POST /grpo/weight_transfer/update`` {buckets: [{names, dtype_names, shapes}], bucket_bytes, num_buffers,
  weight_version, receive}: one weight-update session, one `update_weights` call per bucket (each call receives
  exactly one broadcast; see grpo.sync.buckets), then the prefix cache is reset and the version set. With
  ``receive: direct`` each worker instead receives every bucket itself, on the engine's NCCL group, into a buffer it
  keeps, and loads it with the model's `load_weights` (`WeightSyncExtension.grpo_receive_buckets`).

The packed-transfer geometry (`packed`, `packed_buffer_size_bytes`, `packed_num_buffers`) is per update in 0.26
(`NCCLWeightTransferUpdateInfo`) and per init in 0.32 (`NCCLWeightTransferInitInfo`); `split_wire_fields` puts it
wherever the running vLLM's dataclasses have it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Collection

from grpo.schema import NCCLBroadcastSyncConfig

WIRE_KEYS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
# The phases of an update whose seconds the server reports (the trainer logs each as sync/server_<phase>_seconds).
UPDATE_PHASES = ("start", "receive", "finish", "empty_cache", "reset_prefix_cache")


def wire_params(bucket_bytes: int, num_buffers: int) -> dict[str, Any]:
    return {"packed": True, "packed_buffer_size_bytes": int(bucket_bytes), "packed_num_buffers": int(num_buffers)}


def build_init_info(body: dict, init_fields: Collection[str], update_fields: Collection[str]) -> dict[str, Any]:
    """init_info for `init_weight_transfer_engine`, with the wire params only if this vLLM takes them at init."""
    if not any(k in init_fields or k in update_fields for k in WIRE_KEYS):
        raise RuntimeError("this vLLM's NCCL weight-transfer engine has no packed mode; mode=broadcast needs one")
    info = {
        "master_address": str(body["master_address"]),
        "master_port": int(body["master_port"]),
        "rank_offset": int(body.get("rank_offset", 1)),
        "world_size": int(body["world_size"]),
    }
    wire = wire_params(body["bucket_bytes"], body.get("num_buffers", NCCLBroadcastSyncConfig.num_buffers))
    info.update({k: v for k, v in wire.items() if k in init_fields})
    unknown = set(info) - set(init_fields)
    if unknown:
        raise RuntimeError(f"this vLLM's NCCLWeightTransferInitInfo lacks {sorted(unknown)}")
    return info


def build_update_info(bucket: dict, bucket_bytes: int, num_buffers: int, update_fields: Collection[str]) -> dict:
    """update_info of one bucket for `update_weights`, with the wire params if this vLLM takes them per update."""
    info = {"names": list(bucket["names"]), "dtype_names": list(bucket["dtype_names"]),
            "shapes": [list(s) for s in bucket["shapes"]]}
    wire = wire_params(bucket_bytes, num_buffers)
    info.update({k: v for k, v in wire.items() if k in update_fields})
    return info


def _nccl_fields() -> tuple[set[str], set[str]]:
    from vllm.distributed.weight_transfer import nccl_engine

    init_cls = getattr(nccl_engine, "NCCLWeightTransferInitInfo", None)
    if init_cls is None:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo as init_cls
    return ({f.name for f in dataclasses.fields(init_cls)},
            {f.name for f in dataclasses.fields(nccl_engine.NCCLWeightTransferUpdateInfo)})


def _streams_cached() -> bool:
    # vLLM < 0.32 creates new CUDA streams in every packed receive, stranding the receive buffers' cached memory
    # per call (vLLM gh-52950); there we empty the workers' caches after each update.
    from vllm.distributed.weight_transfer import packed_tensor

    return hasattr(packed_tensor, "_get_streams")


async def handle_init(request) -> dict:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    body = await request.json()
    init_fields, update_fields = _nccl_fields()
    info = build_init_info(body, init_fields, update_fields)
    t0 = time.perf_counter()
    await request.app.state.engine_client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
    return {"status": "initialised", "seconds": time.perf_counter() - t0}


async def handle_update(request) -> dict:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    state = request.app.state
    engine = state.engine_client
    body = await request.json()
    t0 = time.perf_counter()
    phases, lap = {}, [t0]

    def done(phase: str) -> None:  # seconds since the previous phase ended: where a sync's server time goes
        now = time.perf_counter()
        phases[phase], lap[0] = now - lap[0], now

    if body.get("receive") == "direct":  # each worker: its kept buffer, then the model's load_weights
        await engine.collective_rpc("grpo_receive_buckets", kwargs={"buckets": body["buckets"]})
        done("receive")
    else:  # vLLM's weight-transfer engine: one session, one update_weights call per bucket
        _, update_fields = _nccl_fields()
        bucket_bytes = int(body["bucket_bytes"])
        num_buffers = int(body.get("num_buffers", NCCLBroadcastSyncConfig.num_buffers))
        await engine.start_weight_update()
        done("start")
        for bucket in body["buckets"]:
            info = build_update_info(bucket, bucket_bytes, num_buffers, update_fields)
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        done("receive")
        await engine.finish_weight_update()
        done("finish")
        if not _streams_cached():
            await engine.collective_rpc("grpo_empty_cache")
        done("empty_cache")
    # KV blocks cached from the old weights must not be reused.
    await engine.reset_prefix_cache(reset_running_requests=True)
    done("reset_prefix_cache")
    if "weight_version" in body:
        state.grpo_weight_version = int(body["weight_version"])
    return {"weight_version": getattr(state, "grpo_weight_version", 0), "phases": phases,
            "seconds": time.perf_counter() - t0}
