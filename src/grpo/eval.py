"""Evaluate model directories and run checkpoints with a run's evaluator: the `grpo-eval` command (`python -m grpo.eval`).

    grpo-eval outputs/2026-11-28/10-00-00_warm_arith_none/checkpoints/step_000060  # a checkpoint, its run's settings
    grpo-eval --run-dir outputs/2026-11-28/10-00-00_warm_arith_none   # the run's initial weights and every checkpoint
    grpo-eval experiment=smollm2_chat_arith_shared --initial /tmp/trl_out  # the initial model and each checkpoint-N
    grpo-eval experiment=arith_quick                                   # the experiment's initial model

The evaluator is the run's own (grpo.pipeline.evaluation: greedy accuracy, pass@k, mean@k, the same grading, prompts,
token cap, seeds and sampling), built from the config of `eval`, `data`, `model` and `server`. That config is the run's
record (`<run dir>/.hydra/config.yaml`, found from a checkpoint's path or given by `--run-dir`; `key=value` arguments
change it), else the shipped config tree composed with the `key=value` arguments as `grpo-train` composes them.

One vLLM server (the config's `server`: the CPU engine or a GPU) starts on the first full-weight model and every
other model is loaded into it in turn (`/grpo/reload_weights`), as a run's mode=none sync loads its weights; LoRA
adapter checkpoints are served on the run's base model. With `server.external_url` it attaches to a server started
elsewhere (its run token in GRPO_SERVER_TOKEN) and loads each model into it. Results: a table on stdout and JSON
(`--out`, default `<work dir>/eval.json`); the server log and `eval_samples.jsonl` in the work dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from grpo.conf import CONFIG_DIR
from grpo.config import register_configs
from grpo.inference.client import Endpoint, InferenceClient
from grpo.inference.process import VLLMServer
from grpo.models.loading import load_tokenizer
from grpo.pipeline.evaluation import EvalContext, Evaluator, build_evaluator
from grpo.pipeline.generation import GenerationHandle
from grpo.recipes.initial_weights import resolve_model_dir
from grpo.trainer.checkpoint import CheckpointManager, read_trainer_state

log = logging.getLogger("grpo.eval")

# A checkpoint's directory name: ours (step_000060) or a Hugging Face Trainer's, TRL's included (checkpoint-60).
_STEP_NAME = re.compile(r"^(?:step_|checkpoint-)(\d+)$")
RUN_CONFIG = Path(".hydra") / "config.yaml"


class EvalError(RuntimeError):
    """What grpo-eval cannot do with its arguments; the message says what to change."""


@dataclass
class Target:
    """One model to evaluate: a directory of full HF weights or a LoRA adapter, and the step it belongs to."""

    path: Path
    step: int
    # The weight version the server reports while serving it (a checkpoint's own; else the step).
    version: int
    adapter: bool


def _is_model(path: Path) -> bool:
    return (path / "config.json").exists() or (path / "adapter_config.json").exists()


def target(path: Path, step: Optional[int] = None) -> Target:
    """A model directory as an evaluation target: its step from its trainer_state.json (ours: `step`; a Hugging Face
    Trainer's: `global_step`), else from its name (step_N, checkpoint-N), else `step` or 0."""
    path = Path(path).expanduser().resolve()
    if not _is_model(path):
        raise EvalError(f"{path} is neither a model directory (config.json) nor a LoRA adapter (adapter_config.json) "
                        "nor a directory of checkpoints (step_N/, checkpoint-N/)")
    version = None
    state = read_trainer_state(path) if (path / "trainer_state.json").exists() else {}
    if "step" in state or "global_step" in state:
        step, version = int(state.get("step", state.get("global_step"))), state.get("weight_version")
    elif step is None and _STEP_NAME.match(path.name):
        step = int(_STEP_NAME.match(path.name).group(1))
    step = int(step or 0)
    return Target(path, step, int(step if version is None else version), (path / "adapter_config.json").exists())


def run_dir_of(path: Path) -> Optional[Path]:
    """The run dir of one of its checkpoints (<run dir>/checkpoints/step_N), when it holds the run's config."""
    path = Path(path).expanduser().resolve()
    if path.parent.name == "checkpoints" and (path.parent.parent / RUN_CONFIG).exists():
        return path.parent.parent
    return None


def load_config(run_dir: Optional[Path], overrides: list[str]) -> DictConfig:
    """The run's recorded config with `overrides` (key=value) applied, or the shipped tree composed with them."""
    register_configs()  # the config's resolvers and typed schemas
    if run_dir is None:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    path = Path(run_dir) / RUN_CONFIG
    if not path.exists():
        raise EvalError(f"{run_dir} has no {RUN_CONFIG}: give the run dir a train.py run wrote, or compose the "
                        "settings instead (drop --run-dir; e.g. experiment=NAME)")
    cfg = OmegaConf.load(path)
    # A group choice (server=gpu) would replace a whole node by its name: only Hydra's composition can apply it.
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))
           or OmegaConf.is_config(OmegaConf.select(cfg, o.split("=", 1)[0]))]
    if bad:
        raise EvalError(f"with a run's config only key=value changes of its settings apply, not {bad}: to choose "
                        "another group option, drop --run-dir and give the run's overrides with it")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))


def expand(path: Path) -> list[Path]:
    """A model directory, or the checkpoints (step_N/, checkpoint-N/) of a directory that holds them."""
    path = Path(path).expanduser()
    if _is_model(path) or not path.is_dir():
        return [path]
    found = [p for p in path.iterdir() if _STEP_NAME.match(p.name) and _is_model(p)]
    return found or [path]


def targets_of(paths: list[Path], run_dir: Optional[Path], cfg: DictConfig, initial: bool = False) -> list[Target]:
    """The models to evaluate, by step: those given (a directory of checkpoints gives each), with the config's
    initial model at step 0 when `initial`; without paths, the run's initial weights and its complete checkpoints,
    or the config's initial model."""
    if paths:
        given = [target(p) for path in paths for p in expand(path)]
    elif run_dir is not None:
        given, initial = [target(p) for p in CheckpointManager(run_dir).checkpoints()], True
    else:
        given, initial = [], True
    first = [target(Path(resolve_model_dir(cfg.model)), step=0)] if initial else []
    return first + sorted(given, key=lambda t: t.step)


class EvalServer:
    """The vLLM server grpo-eval samples from: launched on `first` (cfg.server) or attached (server.external_url);
    `serve` puts a target's weights on it (a LoRA adapter on `adapter_base`, the run's initial model; None: no
    adapters)."""

    def __init__(self, server_cfg: Any, first: Path, adapter_base: Optional[Path], work_dir: Path) -> None:
        self.base, self.served, self.process = adapter_base, None, None
        url = server_cfg.get("external_url") or (server_cfg.get("external_urls") or [None])[0]
        if url:
            self.client = InferenceClient(str(url).rstrip("/").removesuffix("/v1"),
                                          token=os.environ.get("GRPO_SERVER_TOKEN"))
            if not self.client.health():
                raise EvalError(f"server.external_url={url} does not answer /health: start it, or drop the setting")
        else:
            self.process = VLLMServer(first, server_cfg, log_path=work_dir / "logs" / "vllm.log",
                                      enable_lora=adapter_base is not None, served_model_name=[str(first)])
            self.process.start()
            self.served = first
            self.client = self.process.client()

    def serve(self, t: Target, index: int) -> Endpoint:
        """Serve `t` (reload full weights in place, or load the adapter under a name of its own); its endpoint."""
        model = None
        if t.adapter:
            assert self.base is not None, "EvalServer built without an adapter base"
            if self.served != self.base:
                self.client.reload_weights(str(self.base), version=t.version)
                self.served = self.base
            model = f"eval-{index}"
            self.client.load_lora(model, str(t.path))
        elif self.served != t.path:
            self.client.reload_weights(str(t.path), version=t.version)
            self.served = t.path
        self.client.set_weight_version(t.version, reset_prefix_cache=True)
        return Endpoint(base_url=self.client.base_url, model=model, version=t.version)

    def close(self) -> None:
        self.client.close()
        if self.process is not None:
            self.process.stop()


def evaluator_of(cfg: DictConfig) -> Evaluator:
    """The run's evaluator from `cfg.eval` and `cfg.data`, on even when the run had it off."""
    with open_dict(cfg):
        cfg.eval.enabled = True
    try:
        evaluator = build_evaluator(cfg.eval, cfg.data)
    except ValueError as e:  # each message names the eval/data key to change
        raise EvalError(str(e)) from None
    assert evaluator is not None
    return evaluator


def evaluate(cfg: DictConfig, targets: list[Target], work_dir: Path) -> list[dict[str, Any]]:
    """Evaluate every target on one server; one row per target: model, step and the evaluator's `eval/*`."""
    # Adapters go on the run's initial model; the server starts on the first full-weight model, else on that one.
    adapter_base = Path(resolve_model_dir(cfg.model)).resolve() if any(t.adapter for t in targets) else None
    base = next((t.path for t in targets if not t.adapter), adapter_base)
    evaluator = evaluator_of(cfg)
    server = None
    rows = []
    try:
        server = EvalServer(cfg.server, base, adapter_base, work_dir)
        endpoint: list[Endpoint] = []
        evaluator.setup(EvalContext(tokenizer=load_tokenizer(str(base)),
                                    generation=GenerationHandle(lambda: endpoint[-1]), run_dir=work_dir,
                                    seed=int(cfg.train.seed), total_steps=int(cfg.train.steps),
                                    max_seq_len=int(cfg.model.max_seq_len)))
        for i, t in enumerate(targets):
            endpoint.append(server.serve(t, i))
            # Every target whole (greedy and sampled), whatever eval.sampled_every the run's config says.
            rows.append({"model": str(t.path), "step": t.step, **evaluator.evaluate(t.step, sampled=True)})
            log.info("step %d: accuracy %.4f  %s", t.step, rows[-1]["eval/accuracy"], t.path)
    finally:
        evaluator.close()
        if server is not None:
            server.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table: step, accuracy, pass@k, mean@k, seconds, model."""
    lines = [f"{'step':>6}  {'accuracy':>8}  {'pass@k':>7}  {'mean@k':>7}  {'seconds':>7}  model"]
    for r in rows:
        lines.append(f"{r['step']:>6}  {r['eval/accuracy']:>8.4f}  {r['eval/pass@k']:>7.4f}  {r['eval/mean@k']:>7.4f}  "
                     f"{r['eval/seconds']:>7.2f}  {r['model']}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str], list[Path]]:
    """(options, key=value overrides, model paths): an argument with `=` (or starting with `~`) is an override."""
    p = argparse.ArgumentParser(prog="grpo-eval", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments: model directories / checkpoints (none: see --run-dir) and "
                                       "key=value config overrides (experiment=NAME, server=gpu, eval.k=8, ...).")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="a run dir: its .hydra/config.yaml is the config; without model paths, its initial weights "
                        "and every complete checkpoint are evaluated (default: the run dir of a checkpoint given)")
    p.add_argument("--initial", action="store_true",
                   help="also evaluate the config's initial model (model.*), as step 0, before the paths given")
    p.add_argument("--out", type=Path, default=None, help="the JSON results (default: <work dir>/eval.json)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="server log and eval_samples.jsonl (default: outputs/eval/<date>/<time>)")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    overrides = [a for a in rest if "=" in a or a.startswith("~")]
    return args, overrides, [Path(a) for a in rest if a not in overrides]


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The command line: read the config, evaluate every target on one server, print the table, write the JSON."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, overrides, paths = parse_args(argv)
    try:
        run_dir = args.run_dir or next((r for r in map(run_dir_of, paths) if r is not None), None)
        cfg = load_config(run_dir, overrides)
        targets = targets_of(paths, run_dir, cfg, args.initial)
        work_dir = args.work_dir or Path("outputs") / "eval" / time.strftime("%Y-%m-%d/%H-%M-%S")
        work_dir.mkdir(parents=True, exist_ok=True)
        rows = evaluate(cfg, targets, work_dir)
    except EvalError as e:
        sys.exit(f"grpo-eval: {e}")
    print(table(rows))
    out = args.out or work_dir / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "grpo-eval " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": str(run_dir / RUN_CONFIG) if run_dir is not None else overrides, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
