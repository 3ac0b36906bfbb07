"""Beyond one GPU, the parts testable on CPU: bucket packing (and its wire compatibility with vLLM's packed
weight transfer), HF -> vLLM names for mode=broadcast, the start-up errors of the multi-GPU layouts, and an FSDP2
trainer on 2 gloo processes (same loss and update as 1 process; only rank 0 writes; its checkpoints load in
transformers and resume exactly; `torchrun train.py mode=none` trains, checkpoints and resumes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class

from grpo.conf import CONFIG_DIR
from grpo.config import ConfigError, register_configs
from grpo.inference.launch_args import parallel_sizes
from grpo.pipeline.base import BatchShape, DataPipeline
from grpo.pipeline.rank_broadcast import FollowerPipeline, LeaderPipeline
from grpo.sync.base import SyncStrategy
from grpo.sync.buckets import Bucket, pack, pack_bucket, plan_buckets, unpack_bucket
from grpo.sync.follower import FollowerSync
from grpo.trainer.metrics import NullMetrics
from grpo.trainer.train_batch import IGNORE_INDEX
from grpo.weights.params import full_state_dict, iter_full_params

REPO = Path(__file__).resolve().parents[1]
register_configs()


# ---------------------------------------------------------------- buckets
def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 3, generator=g)),                          # 84 B fp32
        ("b.weight", torch.randn(5, generator=g).to(torch.bfloat16)),          # 10 B, odd element count
        ("c.weight", torch.randn(2, 2, 3, generator=g).to(torch.float16)),     # 24 B
        ("d.idx", torch.arange(6, dtype=torch.int64).view(2, 3)),              # 48 B
        ("e.big", torch.randn(40, 10, generator=g)),                           # 1600 B > bucket
        ("f.flag", torch.tensor([True, False, True])),                         # 3 B
        ("g.scalar", torch.tensor(3.5, dtype=torch.float64)),                  # 8 B, 0-dim
        ("h.empty", torch.empty(0, 4)),                                        # 0 B
        ("i.int8", torch.arange(-5, 6, dtype=torch.int8)),                     # 11 B
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 200, 10_000])
def test_bucket_round_trip(bucket_bytes):
    named = _tensors()
    packed = pack(named, bucket_bytes)
    got = {}
    for buf, bucket in packed:
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.nbytes
        # Offsets are back to back, no padding (vLLM's unpack splits by size in order).
        assert [m.offset for m in bucket.metas] == [sum(x.nbytes for x in bucket.metas[:i]) for i in range(len(bucket.metas))]
        # At most bucket_bytes, unless one tensor alone is bigger.
        assert bucket.nbytes <= bucket_bytes or len(bucket.metas) == 1
        # Every slice is aligned to its dtype (vLLM views them in place).
        assert all(m.offset % torch.empty(0, dtype=getattr(torch, m.dtype)).element_size() == 0 for m in bucket.metas)
        for name, t in unpack_bucket(buf, bucket):
            got[name] = t
    # Every tensor once, in the original order, exact dtype / shape / values.
    assert [n for _, b in packed for n in b.names] == [n for n, _ in named]
    for name, t in named:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name


def test_bucket_boundaries_greedy_and_oversized_alone():
    specs = [("a", "float32", (10,)), ("b", "float32", (10,)), ("c", "float32", (100,)), ("d", "float32", (5,)),
             ("e", "float32", (5,)), ("f", "float32", (5,))]
    buckets = plan_buckets(specs, bucket_bytes=80)  # 40, 40, 400, 20, 20, 20 bytes
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert [b.nbytes for b in buckets] == [80, 400, 60]
    # An int8 of 3 bytes leaves the next float32 misaligned: it starts a new bucket.
    mixed = plan_buckets([("x", "int8", (3,)), ("y", "float32", (2,)), ("z", "int8", (1,))], 1000)
    assert [b.names for b in mixed] == [["x"], ["y", "z"]]
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([("a", "float32", (1,)), ("a", "float32", (1,))], 10)


def test_pack_casts_to_planned_dtype_and_checks_shapes():
    t = torch.randn(4, 4)
    (bucket,) = plan_buckets([("w", torch.bfloat16, (4, 4))], 1 << 20)
    (name, back), = unpack_bucket(pack_bucket(bucket, [t]), bucket)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t.to(torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        pack_bucket(bucket, [torch.randn(4, 5)])


def test_buckets_are_vllm_packed_chunks():
    """Our bucket bytes are what vLLM's packed producer would send for the same tensors and what its unpacker
    reads, and vLLM's chunking closes one chunk exactly at our bucket (so one update_weights call = one bucket)."""
    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    named = _tensors()
    bucket_bytes = 100
    for buf, bucket in pack([(n, t) for n, t in named if t.numel()], bucket_bytes):
        chunk = packed_tensor.pack_tensors(
            iter([(m.name, dict(named)[m.name]) for m in bucket.metas]), lambda x: x[1], bucket_bytes
        )
        assert chunk.names == bucket.names and torch.equal(chunk.packed_tensor, buf)
        out = packed_tensor.unpack_tensor(
            buf.clone(), chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes
        )
        for (name, t), m in zip(out, bucket.metas):
            assert name == m.name and torch.equal(t, dict(named)[name])


def test_weight_transfer_fields_for_both_vllm_versions():
    from grpo.inference.weight_transfer import build_init_info, build_update_info

    body = {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 3, "bucket_bytes": 512, "num_buffers": 2}
    bucket = Bucket()
    bucket = plan_buckets([("x.weight", "bfloat16", (2, 3))], 512)[0].update_info()
    # vLLM 0.26: packed geometry per update.
    init26 = {"master_address", "master_port", "rank_offset", "world_size"}
    upd26 = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
    assert build_init_info(body, init26, upd26) == {"master_address": "127.0.0.1", "master_port": 1234,
                                                    "rank_offset": 1, "world_size": 3}
    u = build_update_info(bucket, 512, 2, upd26)
    assert u["packed"] is True and u["packed_buffer_size_bytes"] == 512 and u["names"] == ["x.weight"]
    # vLLM 0.32: at init.
    init32 = init26 | {"nccl_unique_id_b64", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
    upd32 = {"names", "dtype_names", "shapes"}
    assert build_init_info(body, init32, upd32)["packed_buffer_size_bytes"] == 512
    assert set(build_update_info(bucket, 512, 2, upd32)) == upd32
    # The installed vLLM accepts what we build (its own dataclasses parse it).
    nccl_engine = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    from grpo.inference.weight_transfer import _nccl_fields

    fi, fu = _nccl_fields()
    nccl_engine.NCCLWeightTransferInitInfo(**build_init_info(body, fi, fu))
    nccl_engine.NCCLWeightTransferUpdateInfo(**build_update_info(bucket, 512, 2, fu))


def test_update_route_drives_the_engine_in_order_and_reports_each_phase(monkeypatch):
    """POST /grpo/weight_transfer/update: one update_weights per bucket between start and finish, the prefix cache reset
    last, the version set, and the seconds of every phase (the trainer logs them as sync/server_<phase>_seconds).
    vLLM's engine client is the stand-in here (NCCL needs GPUs); the route's own sequencing is what is tested."""
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import asyncio
    from types import SimpleNamespace

    from grpo.inference import weight_transfer

    calls = []

    class Engine:
        def __getattr__(self, name):
            async def record(*args, **kwargs):
                calls.append(name)
            return record

    monkeypatch.setattr(weight_transfer, "_streams_cached", lambda: False)  # vLLM 0.26: caches emptied
    buckets = [b.update_info() for b in plan_buckets([("a", "float32", (4,)), ("b", "float32", (4,))], 16)]
    state = SimpleNamespace(engine_client=Engine())

    class Request:
        app = SimpleNamespace(state=state)

        async def json(self):
            return {"buckets": buckets, "bucket_bytes": 16, "num_buffers": 2, "weight_version": 7}

    answer = asyncio.run(weight_transfer.handle_update(Request()))
    assert len(buckets) == 2
    assert calls == ["start_weight_update", "update_weights", "update_weights", "finish_weight_update",
                     "collective_rpc", "reset_prefix_cache"]
    assert tuple(answer["phases"]) == weight_transfer.UPDATE_PHASES and answer["weight_version"] == 7
    assert all(v >= 0 for v in answer["phases"].values())
    assert answer["seconds"] >= sum(answer["phases"].values()) - 1e-6


def test_direct_receive_hands_load_weights_the_trainers_tensors_through_one_kept_buffer(monkeypatch):
    """mode.receive=direct, the worker's side: each bucket the trainer packs (grpo.sync.buckets, the bytes NCCL
    carries) reaches the model's load_weights as the same named tensors, through one buffer kept across syncs and
    grown only for a larger bucket. NCCL and vLLM's model are stand-ins (a group that delivers the packed bytes, a
    model whose load_weights records); the worker's receive loop and buffer are what is tested."""
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    from types import SimpleNamespace

    from grpo.inference.worker_extension import WeightSyncExtension

    named = _tensors()
    sent = pack(named, 100)  # [(bytes, Bucket)] as the trainer broadcasts them
    wire = iter([])
    received: list[tuple[str, torch.Tensor]] = []
    buffers: list[int] = []

    class Group:  # NCCL's broadcast: the receiver's buffer gets the sender's bytes
        def broadcast(self, buf, src, stream):
            data = next(wire)
            assert src == 0 and buf.numel() == data.numel()
            buf.copy_(data)
            buffers.append(buf.untyped_storage().data_ptr())

    class Model:
        def load_weights(self, weights):
            received.extend((n, t.clone()) for n, t in weights)

    class Worker(WeightSyncExtension):
        device = torch.device("cpu")
        weight_transfer_engine = SimpleNamespace(model_update_group=Group())
        model_runner = SimpleNamespace(get_model=Model)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: None))
    worker = Worker()
    for _ in range(2):  # two syncs
        wire, received[:] = iter(buf for buf, _ in sent), []
        worker.grpo_receive_buckets([bucket.update_info() for _, bucket in sent])
        assert [n for n, _ in received] == [n for n, _ in named]
        for (name, got), (_, want) in zip(received, named):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert len(set(buffers)) <= 2  # the first buckets grow the buffer at most once more; the second sync reuses it
    assert buffers[len(sent):] == [buffers[len(sent) - 1]] * len(sent)


# ---------------------------------------------------------------- names (mode=broadcast)
def _vllm_shapes(model) -> dict[str, tuple]:
    """vLLM's fused layout of an HF Llama/Qwen2 model (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    fused: dict[str, list] = {}
    out = {}
    for name, p in model.named_parameters():
        for hf, v in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                      ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
            if f".{hf}." in name:
                fused.setdefault(name.replace(hf, v), []).append(p.shape)
                break
        else:
            out[name] = tuple(p.shape)
    for name, shapes in fused.items():
        out[name] = (sum(s[0] for s in shapes), *shapes[0][1:])
    return out


def test_broadcast_names_are_hf_unfused_and_map_onto_vllm(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    from grpo.sync.nccl_broadcast import _maps_by_name, check_against_vllm, hf_weight_name, weight_specs
    from grpo.sync.param_mapping import MappingError

    assert hf_weight_name("_orig_mod.model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_weight_name("module.model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.1.mlp.up_proj.weight"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    specs = weight_specs(model, torch.bfloat16)
    names = [n for n, _, _ in specs]
    assert names == [n for n, _ in model.named_parameters()]          # HF names, unfused, tied head once
    assert any(".q_proj." in n for n in names) and not any("qkv_proj" in n for n in names)
    assert all(dt == torch.bfloat16 for _, dt, _ in specs)
    vllm = [{"name": n, "shape": list(s)} for n, s in _vllm_shapes(model).items()]
    check_against_vllm(specs, vllm, model.config)                      # one worker: names and shapes
    assert all(_maps_by_name(n, {v["name"] for v in vllm}) for n in names)  # tensor parallel: names only
    with pytest.raises(MappingError):
        check_against_vllm(specs[:-1], vllm, model.config)             # a vLLM parameter nobody sends
    with pytest.raises(MappingError):
        check_against_vllm(specs + [("model.extra.weight", torch.float32, (3,))], vllm, model.config)


# ---------------------------------------------------------------- start-up errors of the layouts
def _compose(overrides):
    GlobalHydra.instance().clear()
    # The bare config (~experiment) unless the test picks an experiment: the default job's arith_quick is tested
    # on its own (tests/test_config.py::test_the_default_job_is_the_arithmetic_experiment).
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["~experiment", *overrides]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_parallel_sizes_from_extra_args():
    assert parallel_sizes([]) == {"tensor": 1, "pipeline": 1, "data": 1}
    assert parallel_sizes(["--tensor-parallel-size", "2", "-pp=2"]) == {"tensor": 2, "pipeline": 2, "data": 1}
    assert parallel_sizes(["--tensor-parallel-size=4"])["tensor"] == 4
    with pytest.raises(ConfigError, match="integer"):
        parallel_sizes(["-tp", "two"])


@pytest.mark.parametrize("args", [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--pipeline-parallel-size", "2"]])
def test_shared_vllm_with_vllm_parallelism_fails_clearly(args, tmp_path):
    from grpo.config import validate

    cfg = _compose(["mode=shared_vllm", f"server.extra_args=[{','.join(args)}]"])
    for cuda in (True, False):
        with pytest.raises(ConfigError, match=r"mode=broadcast.*tp=1"):
            get_class(cfg.mode._target_).check_config(cfg, cuda=cuda)
    with pytest.raises(ConfigError, match="does not support vLLM"):
        validate(cfg, tmp_path)  # what train.py runs before any model loads
    get_class(cfg.mode._target_).check_config(_compose(["mode=shared_vllm"]), cuda=True)  # tp=1 is fine


def test_broadcast_layout_errors():
    cls = get_class("grpo.sync.nccl_broadcast.NCCLBroadcastSync")
    with pytest.raises(ConfigError, match="server.device"):
        cls.check_config(_compose(["mode=broadcast", "server=gpu"]), cuda=True)
    with pytest.raises(ConfigError, match="needs CUDA"):
        cls.check_config(_compose(["mode=broadcast", "server.device=1"]), cuda=False)
    cls.check_config(_compose(["experiment=qwen3b_broadcast_2gpu"]), cuda=True)
    with pytest.raises(ConfigError, match=">= 2"):  # torchrun with 2 trainer ranks: vLLM needs GPU 2+
        cls.check_config(_compose(["experiment=qwen3b_broadcast_2gpu"]), cuda=True, world_size=2)
    # torchrun (FSDP2): mode=none, mode=broadcast and the LoRA modes (the adapter gathered) compose; shared_vllm
    # stops with what works.
    for mode in ("none", "lora_only", "lora_restart"):
        cfg = _compose([f"mode={mode}", "server.dtype=bfloat16"])
        get_class(cfg.mode._target_).check_config(cfg, cuda=True, world_size=2)
    cfg = _compose(["mode=shared_vllm"])
    with pytest.raises(ConfigError, match=r"composes with mode=none, mode=broadcast, mode=lora_only or "
                                          r"mode=lora_restart, not mode=shared_vllm"):
        get_class(cfg.mode._target_).check_config(cfg, cuda=True, world_size=2)


def test_broadcast_across_nodes_counts_the_trainer_gpus_of_vllms_host():
    """torchrun --nnodes 2 --nproc-per-node 2: four ranks, two on each host; vLLM beside rank 0 needs GPU 2 there, not 4."""
    cls = get_class("grpo.sync.nccl_broadcast.NCCLBroadcastSync")
    cls.check_config(_compose(["experiment=qwen3b_broadcast_2gpu", "server.device=2"]), cuda=True, world_size=4,
                     local_world_size=2)
    with pytest.raises(ConfigError, match=r"server.device to a GPU index >= 2 \(server.device=1\)"):
        cls.check_config(_compose(["experiment=qwen3b_broadcast_2gpu", "server.device=1"]), cuda=True, world_size=4,
                         local_world_size=2)
    with pytest.raises(ConfigError, match=r"server.device to a GPU index >= 4 \(server.device=2\)"):  # one host
        cls.check_config(_compose(["experiment=qwen3b_broadcast_2gpu", "server.device=2"]), cuda=True, world_size=4)


# ---------------------------------------------------------------- FSDP2 on 2 gloo processes
def _groups(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(2):
        prompt = torch.randint(0, 250, (5,), generator=g).tolist()
        tokens, masks, lps = [], [], []
        for j in range(3):
            comp = torch.randint(0, 250, (4 + j,), generator=g).tolist()
            tokens.append(prompt + comp)
            masks.append([IGNORE_INDEX] * len(prompt) + comp)
            lps.append([1.0] * len(prompt) + [-1.5 - 0.1 * i for i in range(len(comp))])
        groups.append({"tokens": tokens, "masks": masks, "scores": [0.0, 1.0, 0.5 + k], "advantages": None,
                       "ref_logprobs": None, "inference_logprobs": lps, "generation_params": None,
                       "overrides": None, "group_overrides": None, "messages": None, "env_id": 0})
    return groups


class _Pipeline(DataPipeline):
    """Fixed groups every step (the data path is not what this test is about)."""

    def __init__(self, pad_token_id: int, micro_batch_size: int = 2) -> None:
        self.ctx = SimpleNamespace(batch_shape=BatchShape(micro_batch_size=micro_batch_size, max_seq_len=64,
                                                          pad_token_id=pad_token_id))

    def setup(self, ctx):
        pass

    def next_groups(self, step):
        return _groups()


class _StepPipeline(_Pipeline):
    """Other groups every step, so a resumed run must take up the data where it stopped."""

    def next_groups(self, step):
        self.step = step
        return _groups(seed=100 + step)


class _GatherSync(SyncStrategy):
    """Rank 0's stand-in for mode=broadcast: takes every full parameter (the gathers the real sync does)."""

    fsdp_gather = "params"

    def __init__(self):
        super().__init__()
        self.checksum, self.names = 0.0, []

    def sync(self, model, step):
        self.names, self.checksum = [], 0.0
        for name, t in iter_full_params(model):
            self.names.append(name)
            self.checksum += float(t.double().abs().sum()) + float(t.double().sum())
        self.version += 1
        return {"sync/seconds": 0.0, "sync/version": float(self.version)}


def _loss(name: str):
    """The losses the FSDP2 runs train with: GRPO's, and GSPO with both off-policy masks (issue 40: a loss that is
    not token-separable, whose sequence terms pool tokens that may sit in one rank's micro-batch)."""
    from grpo.trainer.loss import GRPOLoss

    if name == "gspo_masks":
        # The scripted rollout log-probs lie ~3.5 nats above the tiny model's: bands that mask some tokens only.
        # With an entropy bonus: its gradient through FSDP2's sharded head (unfused) as through the fused path; and a
        # KL penalty against a reference policy sharded as the policy is (`_reference`).
        return GRPOLoss(objective="gspo", clip_eps=0.01, clip_eps_high=0.01, aggregation="seq_mean_token_mean",
                        token_mask=[0.02, 50.0], sequence_mask=[0.01, 100.0], entropy_coef=0.05, kl_coef=0.1)
    return GRPOLoss()


def _reference(loss, model_dir: str, sharded: bool):
    """The KL penalty's reference when `loss` needs one: the tiny model with seeded noise on every weight (a policy
    equal to its reference would give KL 0 and no gradient), sharded under FSDP2."""
    from transformers import AutoModelForCausalLM

    from grpo.trainer import fsdp
    from grpo.trainer.reference import ReferencePolicy

    if not loss.needs.reference_policy:
        return None
    copy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    if sharded:
        fsdp.shard_model(copy)
    return ReferencePolicy.frozen_copy(copy, fsdp.sharded_token_logprobs(copy) if sharded else None)


def _train_one_step(rank: int, world: int, port: int, model_dir: str, out_root: str, loss: str = "grpo",
                    micro_batch_size: int = 2) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.schema import LoggingConfig, TrainConfig
    from grpo.trainer import fsdp
    from grpo.trainer.checkpoint import CheckpointManager
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.metrics import MetricsLogger
    from grpo.trainer.optim import build_scheduler

    torch.manual_seed(0)
    info = fsdp.init_from_env("cpu")
    run_dir = Path(out_root) / f"world{world}_rank{rank}"
    run_dir.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if info.enabled:
        fsdp.shard_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = OmegaConf.structured(TrainConfig(steps=1, micro_batch_size=micro_batch_size,
                                           grad_accum=max(1, 6 // micro_batch_size), checkpoint_every=1,
                                           max_grad_norm=None))
    log_cfg = OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False))
    rank0 = rank == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id
    source = _Pipeline(pad, micro_batch_size)
    pipeline = source if not info.enabled else (LeaderPipeline(source) if rank0 else FollowerPipeline())
    sync = _GatherSync() if rank0 else FollowerSync()
    loss_fn = _loss(loss)
    trainer = GRPOTrainer(
        train_cfg=cfg, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, "constant", 0, 1), loss_fn=loss_fn, pipeline=pipeline, sync=sync,
        checkpoints=CheckpointManager(run_dir, keep=1),
        metrics=MetricsLogger(run_dir, log_cfg, cfg, 1, 0) if rank0 else NullMetrics(),
        device=info.device, start_step=0, dist=info, reference=_reference(loss_fn, model_dir, info.enabled),
        logprob_fn=fsdp.sharded_token_logprobs(model) if info.enabled else None,
    )
    trainer.fit()
    trainer.metrics.close()
    # The weights after the step, as every rank helps gather them (the checkpoint must hold exactly these).
    gathered = full_state_dict(model) if info.enabled else model.state_dict()
    if rank0:
        row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        (Path(out_root) / f"result_world{world}.json").write_text(json.dumps(
            {"loss": row["loss"], "grad_norm": row["grad_norm"], "logprob_diff": row["grpo/logprob_diff"],
             "entropy": row["grpo/entropy"], "kl": row["grpo/kl"],
             "checksum": sync.checksum, "names": sync.names, "masked": row["mismatch/masked_fraction"]}))
        torch.save({k: v.detach().clone() for k, v in gathered.items()}, Path(out_root) / f"gathered_world{world}.pt")
    if info.enabled:
        # Both ranks leave together: rank 1 tearing gloo down while rank 0 still wrote its files once aborted rank 1
        # ("terminate called without an active exception", SIGABRT) in a full-suite run on a loaded 2-core machine.
        torch.distributed.barrier()
    fsdp.destroy()


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory, tiny_qwen2_dir) -> Path:
    """One optimizer step (checkpoint_every=1) in 1 process, then on 2 gloo ranks with FSDP2; their outputs."""
    from conftest import one_process_then_two_gloo_ranks

    out = tmp_path_factory.mktemp("fsdp_one_step")
    one_process_then_two_gloo_ranks(_train_one_step, tiny_qwen2_dir, out)
    return out


@pytest.mark.slow
def test_fsdp2_gspo_with_off_policy_masks_matches_one_process(tmp_path, tiny_qwen2_dir):
    """Issue 40: GSPO's sequence ratio and both masks under FSDP2 (its log-probs through the sharded forward, the
    loss unfused) give the one-process loss and update, an entropy bonus's gradient and a KL penalty against a
    sharded reference policy included."""
    from conftest import one_process_then_two_gloo_ranks

    one_process_then_two_gloo_ranks(_train_one_step, tiny_qwen2_dir, tmp_path, "gspo_masks")
    one = json.loads((tmp_path / "result_world1.json").read_text())
    two = json.loads((tmp_path / "result_world2.json").read_text())
    assert 0 < one["masked"] < 1 and one["loss"] != 0 and one["kl"] > 1e-3
    assert abs(two["loss"] - one["loss"]) < 1e-5 and abs(two["masked"] - one["masked"]) < 1e-6
    assert abs(two["kl"] - one["kl"]) < 1e-6 * max(1.0, one["kl"])
    assert abs(two["grad_norm"] - one["grad_norm"]) < 1e-5 * max(1.0, one["grad_norm"])
    assert abs(two["checksum"] - one["checksum"]) < 1e-5 * abs(one["checksum"])


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_fsdp2_step_of_one_micro_batch_matches_one_process(tmp_path, tiny_qwen2_dir):
    """A rollout batch that fits one micro-batch (train.skip_zero_advantage leaves few rows): rank 1 runs only the
    zero-weighted repeat and must still reduce the same metrics as rank 0. On the GPU its missing metric keys made the
    ranks' all-reduces differ in size and the run hung until NCCL's watchdog aborted it (lease 6)."""
    from conftest import one_process_then_two_gloo_ranks

    one_process_then_two_gloo_ranks(_train_one_step, tiny_qwen2_dir, tmp_path, "grpo", 6)
    one = json.loads((tmp_path / "result_world1.json").read_text())
    two = json.loads((tmp_path / "result_world2.json").read_text())
    assert one["loss"] != 0 and abs(two["loss"] - one["loss"]) < 1e-5
    assert abs(two["logprob_diff"] - one["logprob_diff"]) < 1e-5
    # The tokens' entropies through FSDP2's registered log-prob method (unfused) as in one process (fused).
    assert one["entropy"] > 0 and abs(two["entropy"] - one["entropy"]) < 1e-5
    assert abs(two["checksum"] - one["checksum"]) < 1e-5 * abs(one["checksum"])


def test_fsdp2_two_gloo_ranks_match_one_process(one_step_runs):
    """6 sequences in 3 micro-batches of 2: rank 0 trains 2, rank 1 trains 1 plus a zero-weighted one."""
    tmp_path = one_step_runs
    one = json.loads((tmp_path / "result_world1.json").read_text())
    two = json.loads((tmp_path / "result_world2.json").read_text())
    assert two["names"] == one["names"] and len(one["names"]) > 10
    assert abs(two["loss"] - one["loss"]) < 1e-5, (one["loss"], two["loss"])
    assert abs(two["logprob_diff"] - one["logprob_diff"]) < 1e-5
    # The tokens' entropies through FSDP2's registered log-prob method (unfused) as in one process (fused).
    assert one["entropy"] > 0 and abs(two["entropy"] - one["entropy"]) < 1e-5
    assert abs(two["grad_norm"] - one["grad_norm"]) < 1e-5 * max(1.0, one["grad_norm"])
    # The same update: full weights after the step agree (sum of |w| + sum of w over all parameters).
    assert abs(two["checksum"] - one["checksum"]) < 1e-5 * abs(one["checksum"])
    # Only rank 0 wrote anything: metrics and the checkpoint.
    assert (tmp_path / "world2_rank0" / "metrics.jsonl").exists()
    assert list((tmp_path / "world2_rank1").iterdir()) == []
    assert (tmp_path / "world2_rank0" / "checkpoints" / "step_000001" / "COMPLETE").exists()


def test_fsdp2_checkpoint_is_the_single_process_format_and_reloads_with_the_gathered_logits(one_step_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo.trainer.checkpoint import CheckpointManager

    fsdp = CheckpointManager(one_step_runs / "world2_rank0").latest()
    single = CheckpointManager(one_step_runs / "world1_rank0").latest()
    assert fsdp.name == single.name == "step_000001"
    # The same files (plus every rank's RNG) and the same tensor names: unfused, tied lm_head once.
    assert {p.name for p in fsdp.iterdir()} == {p.name for p in single.iterdir()} | {"rng_ranks.pt"}
    names = set(load_file(fsdp / "model.safetensors"))
    assert names == set(load_file(single / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert json.loads((fsdp / "trainer_state.json").read_text())["step"] == 1
    assert len(torch.load(fsdp / "rng_ranks.pt", weights_only=False)) == 2

    # transformers loads it and computes the logits of the weights the ranks gathered after the step.
    gathered = torch.load(one_step_runs / "gathered_world2.pt")
    reloaded = AutoModelForCausalLM.from_pretrained(fsdp, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).eval()
    reference.load_state_dict(gathered)
    ids = torch.tensor([_groups()[0]["tokens"][0], _groups()[1]["tokens"][2][:9]])
    with torch.no_grad():
        got, want = reloaded(input_ids=ids).logits, reference(input_ids=ids).logits
        one_process = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got, one_process, atol=1e-5, rtol=1e-5)  # and the 1-process step's checkpoint


# ---------------------------------------------------------------- FSDP2 resume == straight
def _fsdp_phase(info, model_dir: str, run_dir: Path, steps: int, resume: Path | None = None):
    """Train to `steps` with FSDP2 (AdamW, warm-up + cosine, clipping, checkpoint every 2), from `resume`'s latest
    checkpoint when given; returns the full weights after the last step (rank 0) and the metrics rows."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.schema import LoggingConfig, TrainConfig
    from grpo.trainer import fsdp
    from grpo.trainer.checkpoint import CheckpointManager
    from grpo.trainer.loop import GRPOTrainer
    from grpo.trainer.loss import GRPOLoss
    from grpo.trainer.metrics import MetricsLogger
    from grpo.trainer.optim import build_scheduler

    rank0 = info.is_rank0
    model = fsdp.shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = build_scheduler(optimizer, "cosine", 1, 4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pipeline = LeaderPipeline(_StepPipeline(tokenizer.pad_token_id)) if rank0 else FollowerPipeline()
    start = 0
    if resume is not None:
        state = CheckpointManager(resume).load_distributed(CheckpointManager(resume).latest(), model, optimizer,
                                                           scheduler)
        start = int(state["step"])
        pipeline.load_state_dict(state["data"])
    cfg = OmegaConf.structured(TrainConfig(steps=steps, micro_batch_size=2, grad_accum=3, checkpoint_every=2,
                                           max_grad_norm=1.0))
    log_cfg = OmegaConf.structured(LoggingConfig(progress_bar=False, plot=False))
    trainer = GRPOTrainer(
        train_cfg=cfg, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=scheduler, loss_fn=GRPOLoss(), pipeline=pipeline,
        sync=_GatherSync() if rank0 else FollowerSync(),
        checkpoints=CheckpointManager(run_dir, keep=1),
        metrics=MetricsLogger(run_dir, log_cfg, cfg, steps, start) if rank0 else NullMetrics(),
        device=info.device, start_step=start, dist=info, logprob_fn=fsdp.sharded_token_logprobs(model),
    )
    trainer.fit()
    trainer.metrics.close()
    assert scheduler.last_epoch == steps
    weights = full_state_dict(model)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if rank0 else []
    return weights, rows


def _resume_worker(rank: int, world: int, port: int, model_dir: str, out_root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from grpo.trainer import fsdp

    info = fsdp.init_from_env("cpu")
    out = Path(out_root)
    runs = {name: out / f"{name}_rank{rank}" for name in ("straight", "first")}
    for d in runs.values():
        d.mkdir()
    torch.manual_seed(0)
    straight, straight_rows = _fsdp_phase(info, model_dir, runs["straight"], 4)
    torch.manual_seed(0)
    first, _ = _fsdp_phase(info, model_dir, runs["first"], 2)
    torch.manual_seed(999)  # a new process would start from other RNG states
    # Resume into the same run dir, as `train.resume=<run dir>` does (rank 0's holds the checkpoints).
    resumed, resumed_rows = _fsdp_phase(info, model_dir, runs["first"], 4, resume=out / "first_rank0")
    if info.is_rank0:
        torch.save({"straight": straight, "first": first, "resumed": resumed, "straight_rows": straight_rows,
                    "resumed_rows": resumed_rows}, out / "resume_results.pt")
    torch.distributed.barrier()  # both ranks leave together (see _train_one_step)
    fsdp.destroy()


@pytest.mark.slow
def test_fsdp2_two_plus_two_steps_with_resume_equal_four_straight(tmp_path, tiny_qwen2_dir):
    import torch.multiprocessing as mp

    from conftest import free_port
    from grpo.trainer.checkpoint import CheckpointManager

    mp.spawn(_resume_worker, args=(2, free_port(), str(tiny_qwen2_dir), str(tmp_path)), nprocs=2, join=True)
    r = torch.load(tmp_path / "resume_results.pt", weights_only=False)
    assert r["straight"].keys() == r["resumed"].keys() and len(r["straight"]) > 10
    for name in r["straight"]:
        torch.testing.assert_close(r["resumed"][name], r["straight"][name], atol=1e-6, rtol=1e-6, msg=name)
    # The steps after the resume really moved the weights, and saw the same losses and gradients.
    assert any(not torch.equal(r["first"][n], r["straight"][n]) for n in r["straight"])
    assert [row["step"] for row in r["resumed_rows"]] == [1, 2, 3, 4]
    for a, b in zip(r["straight_rows"][2:], r["resumed_rows"][2:]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["lr"] == pytest.approx(b["lr"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert list((tmp_path / "first_rank1").iterdir()) == []  # rank 1 wrote nothing

    # A single process loads the FSDP2 checkpoint too (the optimizer state is keyed by name there).
    from transformers import AutoModelForCausalLM

    from grpo.trainer.optim import build_scheduler

    ckpt = CheckpointManager(tmp_path / "first_rank0").latest()
    assert ckpt.name == "step_000004"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = build_scheduler(optimizer, "cosine", 1, 4)
    assert CheckpointManager(tmp_path / "first_rank0").load(ckpt, model, optimizer, scheduler)["step"] == 4
    assert scheduler.last_epoch == 4
    assert all("exp_avg" in optimizer.state[p] for p in model.parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), r["resumed"][name], atol=0, rtol=0, msg=name)


# ---------------------------------------------------------------- torchrun train.py, mode=none (real vLLM on CPU)
@pytest.mark.slow  # 40-105 s of the CI suite's 25-minute budget: run with `pytest -m slow`
@pytest.mark.vllm
def test_torchrun_two_ranks_mode_none_trains_checkpoints_and_resumes(tmp_path, train_server, tiny_qwen2_dir):
    """`torchrun --nproc-per-node 2 train.py mode=none`: every rank joins each gather of the full weights, rank 0
    saves them for vLLM (reloaded in place), writes the checkpoints and resumes from them."""
    import subprocess
    import sys
    import uuid

    from conftest import attach, free_port
    from test_train_e2e import QUICK, assert_clean, metrics

    run_dir = tmp_path / "run"
    port = free_port()

    def torchrun(*overrides, env=None):
        marker = f"GRPO_TEST_{uuid.uuid4().hex}"
        env = dict(os.environ, **(env or {}), GRPO_TEST_MARKER=marker, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(REPO / "train.py"), "mode=none", *QUICK, "train.checkpoint_every=1",
               f"hydra.run.dir={run_dir}", *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=540, env=env)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
        assert_clean(marker)

    torchrun("train.steps=2", f"server.port={port}")  # rank 0 starts and stops its own vLLM
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/inplace"] == 1.0 for r in rows) and [r["sync/version"] for r in rows] == [1.0, 2.0]
    complete = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert complete == ["step_000001", "step_000002"]
    assert (run_dir / "served_weights" / "v2" / "model.safetensors").exists()

    # The resume attaches to the session's server (one vLLM start-up less).
    external, env = attach(train_server, tiny_qwen2_dir)
    torchrun("train.steps=3", f"train.resume={run_dir}", external, env=env)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["sync/version"] == 3.0  # the weight version goes on from the checkpoint's
    assert json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["step"] == 3


def test_single_process_optimizer_state_converts_to_the_fsdp2_form(tiny_qwen2_dir):
    """What `load_distributed` does with a single process's `optimizer.pt` (numbered parameters): the same
    name-keyed full state `get_optimizer_state_dict` gives, so an FSDP2 run resumes a single-process run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    from grpo.trainer.checkpoint import _by_name, _keyed_by_name

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": [p for n, p in model.named_parameters()
                                                                  if "norm" in n], "weight_decay": 0.0}])
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()
    numbered = optimizer.state_dict()
    assert not _keyed_by_name(numbered)
    named = _by_name(numbered, model, optimizer)
    want = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert _keyed_by_name(named) and named["state"].keys() == want["state"].keys()
    assert [g["params"] for g in named["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for name, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(named["state"][name][k], v), (name, k)
    assert _by_name(want, model, optimizer) is want  # already by name: as is


def test_server_started_by_a_torchrun_rank_gets_no_rank_variables(monkeypatch, tmp_path):
    """vLLM started by rank 0 must not inherit RANK/WORLD_SIZE/MASTER_* (it is not in the trainer's group)."""
    from grpo.inference.process import VLLMServer

    torchrun_env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
                    "GROUP_RANK": "0", "ROLE_RANK": "0"}
    for k, v in torchrun_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_KEEP_ME", "1")
    env = VLLMServer(tmp_path / "model", {"device": 1}, tmp_path / "vllm.log").environment()
    assert not set(torchrun_env) & set(env)
    assert env["GRPO_KEEP_ME"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"


def _sum_keys_of_rank(rank: int, world: int, port: int, out_root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from grpo.trainer import fsdp

    fsdp.init_from_env("cpu")
    result = {"same": fsdp.all_reduce_sum({"loss": 1.0 + rank, "kl": 2.0})}
    try:  # rank 1 lacks a key: a clear error on both ranks, not a mismatched collective
        fsdp.all_reduce_sum({"loss": 1.0, "kl": 2.0} if rank == 0 else {"loss": 1.0})
    except RuntimeError as error:
        result["error"] = str(error)
    (Path(out_root) / f"rank{rank}.json").write_text(json.dumps(result))
    fsdp.destroy()


@pytest.mark.timeout(120)
def test_metric_sums_over_ranks_refuse_different_keys_on_every_rank(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_sum_keys_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["same"] == {"kl": 4.0, "loss": 3.0}
        assert "different metrics" in result["error"] and f"rank {rank}" in result["error"]
