"""Each default is written once, in the typed schema (grpo.schema): a group option's YAML holds only what differs from
the schema (or from the option it builds on), an experiment only what differs from the groups it selects, and a
component built from a schema has no constructor default that disagrees with it."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

import grpo.schema
from grpo.conf import CONFIG_DIR, EXPERIMENTS_DIR
from grpo.config import register_configs

register_configs()

# (file relative to the repository root, dotted key) -> why it may restate the value it overrides. `_target_` is
# always kept: it names the class an option builds, which a reader of the file looks for first.
ALLOWED: dict[tuple[str, str], str] = {}
# (class, parameter) -> why its constructor default may differ from its schema's.
CONSTRUCTOR_ALLOWED: dict[tuple[str, str], str] = {
    ("grpo.pipeline.evaluation.Evaluator", "max_new_tokens"):
        "eval.max_new_tokens null stands for data.max_new_tokens (build_evaluator resolves it): the constructor's "
        "default is LocalDataConfig's",
    ("grpo.pipeline.agents.AgentPipeline", "rewards"): "None, like the schema's {}, is no rewards (the rollout scores)",
}


def _plain(value: Any) -> Any:
    """A comparable value: containers as plain data, enums as their names, numbers as floats."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=False, enum_to_str=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _leaves(node: Any, prefix: str = ""):
    """(dotted key, value) of each leaf of a plain mapping; a list is one leaf."""
    for key, value in node.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _leaves(value, dotted)
        else:
            yield dotted, value


def _nothing_to_restate(base: DictConfig, dotted: str) -> bool:
    """True when `base` has no value of its own at `dotted`: absent, ??? in the schema, or an interpolation (an
    experiment's `optimizer.lr: 1e-4` pins what `${model.lr}` would follow: another model on the command line keeps
    it)."""
    parent, _, key = dotted.rpartition(".")
    node = OmegaConf.select(base, parent, throw_on_missing=False) if parent else base
    return (not OmegaConf.is_dict(node) or key not in node or OmegaConf.is_missing(node, key)
            or OmegaConf.is_interpolation(node, key))


def restated(own: dict, base: DictConfig, where: str) -> list[str]:
    """The keys of `own` (an option's or experiment's body) whose value is the one `base` already has."""
    out = []
    for dotted, value in _leaves(own):
        if dotted.rsplit(".", 1)[-1] == "_target_" or (where, dotted) in ALLOWED or _nothing_to_restate(base, dotted):
            continue
        if _plain(value) == _plain(OmegaConf.select(base, dotted, throw_on_missing=False)):
            out.append(f"{where}: {dotted}: {value!r} is the default it overrides")
    return out


def _body(path: Path) -> tuple[list, dict]:
    """(defaults list, the rest) of a config file."""
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return node.pop("defaults", []), node


def option_base(config_dir: Path, group: str, option: str) -> DictConfig:
    """What group option `option`'s own keys override: its defaults list (a `*_schema` node of the ConfigStore, or
    another option of the group) merged in order, without the option's own body."""
    defaults, _ = _body(config_dir / group / f"{option}.yaml")
    base = OmegaConf.create()
    for entry in defaults:
        if entry == "_self_":
            continue
        if entry.endswith("_schema"):
            part = OmegaConf.structured(ConfigStore.instance().load(f"{group}/{entry}.yaml").node)
        else:
            part = _option(config_dir, group, entry)
        base = OmegaConf.merge(base, part)
    return base


def group_option_restatements(config_dir: Path) -> list[str]:
    out = []
    for group_dir in sorted(d for d in config_dir.iterdir() if d.is_dir() and d.name not in {"sweep", "__pycache__"}):
        for path in sorted(group_dir.glob("*.yaml")):
            where = str(path.relative_to(config_dir.parent))
            out += restated(_body(path)[1], option_base(config_dir, group_dir.name, path.stem), where)
    return out


def primary_restatements(config_dir: Path) -> list[str]:
    """The nodes of train.yaml that restate the root schema's defaults (train, logging, name)."""
    _, own = _body(config_dir / "train.yaml")
    own.pop("hydra", None)
    return restated(own, OmegaConf.structured(grpo.schema.RootConfig), "conf/train.yaml")


# An experiment's train, logging and name nodes are its recipe, pinned on purpose (a reader of the file sees the run it
# is); the check covers the group nodes, where a key equal to the selected option's value restates that option.
EXPERIMENT_OWN_NODES = {"train", "logging", "name"}


@functools.cache
def _option(config_dir: Path, group: str, option: str) -> DictConfig:
    return OmegaConf.merge(option_base(config_dir, group, option), _body(config_dir / group / f"{option}.yaml")[1])


def _experiment_parts(experiments_dir: Path, name: str, choices: dict) -> list[dict]:
    """The bodies an experiment's config merges before its own (its parent experiments', in order), and `choices`
    (group -> option) updated with the `override /group: option` entries of its defaults list and its parents'."""
    defaults, _ = _body(experiments_dir / f"{name}.yaml")
    bodies = []
    for entry in defaults:
        if isinstance(entry, dict):
            for key, option in entry.items():
                choices[key.removeprefix("override").strip().lstrip("/")] = option
        elif entry != "_self_":
            bodies += _experiment_parts(experiments_dir, entry, choices) + [_body(experiments_dir / f"{entry}.yaml")[1]]
    return bodies


def experiment_restatements(config_dir: Path, experiments_dir: Path, names: list[str] | None = None) -> list[str]:
    """Each experiment's group keys whose value the config already has without the experiment's own body: the group
    options it selects (conf/train.yaml's, then its `override`s and its parent experiments'), with its parents'
    bodies merged on top."""
    defaults = _body(config_dir / "train.yaml")[0]
    primary = {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}
    out = []
    for name in names or sorted(p.stem for p in experiments_dir.glob("*.yaml")):
        choices = dict(primary)
        bodies = _experiment_parts(experiments_dir, name, choices)
        groups = {g: _option(config_dir, g, o) for g, o in choices.items() if o is not None and g != "experiment"}
        base = OmegaConf.merge(OmegaConf.create(groups), *bodies)
        own = {k: v for k, v in _body(experiments_dir / f"{name}.yaml")[1].items() if k not in EXPERIMENT_OWN_NODES}
        out += restated(own, base, f"experiments/{name}.yaml")
    return out


def test_no_group_option_restates_a_default():
    """A key of conf/<group>/<option>.yaml equal to the schema default (or the base option's value) it overrides is a
    default written twice: one of the two goes stale when the other changes."""
    problems = group_option_restatements(CONFIG_DIR) + primary_restatements(CONFIG_DIR)
    assert not problems, "remove these keys (the schema holds the default), or allow one in ALLOWED with a reason:\n" \
        + "\n".join(problems)


def test_no_experiment_restates_what_its_groups_set():
    problems = experiment_restatements(CONFIG_DIR, EXPERIMENTS_DIR)
    assert not problems, "remove these keys from the experiment:\n" + "\n".join(problems)


def test_a_planted_restatement_is_found(tmp_path):
    """The checks above find a default written twice: one planted in a copy of the config tree and experiments."""
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    with (conf / "server" / "gpu.yaml").open("a") as f:
        f.write("\nmax_lora_rank: 64\n")
    with (conf / "loss" / "gspo.yaml").open("a") as f:
        f.write("\nkl_coef: 0.0\n")  # grpo.yaml, the option gspo builds on, leaves it at the schema's 0.0
    with (conf / "train.yaml").open("a") as f:
        f.write("\nlogging:\n  plot: true\n")
    found = group_option_restatements(conf) + primary_restatements(conf)
    assert any("conf/server/gpu.yaml: max_lora_rank" in p for p in found), found
    assert any("conf/loss/gspo.yaml: kl_coef" in p for p in found), found
    assert any("conf/train.yaml: logging.plot" in p for p in found), found
    experiments = tmp_path / "experiments"
    shutil.copytree(EXPERIMENTS_DIR, experiments)
    with (experiments / "arith_quick.yaml").open("a") as f:
        f.write("\nloss:\n  clip_eps: 0.2\n")
    found = experiment_restatements(CONFIG_DIR, experiments, ["arith_quick"])
    assert any("experiments/arith_quick.yaml: loss.clip_eps" in p for p in found), found


def _schema_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else inspect.Parameter.empty


SCHEMAS_WITH_TARGET = [
    cls for cls in (getattr(grpo.schema, name) for name in grpo.schema.__all__)
    if dataclasses.is_dataclass(cls) and any(f.name == "_target_" for f in dataclasses.fields(cls))
    and str(cls._target_).startswith("grpo.")  # third-party classes (torch's AdamW) keep their own defaults
]


@pytest.mark.parametrize("schema", SCHEMAS_WITH_TARGET, ids=lambda s: s.__name__)
def test_constructor_defaults_agree_with_the_schema(schema):
    """A component built from its schema (`_target_`) takes the schema's values; a default of its constructor for one
    of the schema's keys is the schema's default, or none (so a component built in code behaves as a configured one)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems = []
    for param in inspect.signature(get_class(schema._target_)).parameters.values():
        if (param.name in fields and param.default is not inspect.Parameter.empty
                and (schema._target_, param.name) not in CONSTRUCTOR_ALLOWED):
            expected = _schema_default(fields[param.name])
            if _plain(param.default) != _plain(expected):
                problems.append(f"{schema._target_}({param.name}={param.default!r}) vs {schema.__name__}: {expected!r}")
    assert not problems, "\n".join(problems)


# (file, key) -> why its code may write a literal default equal to a schema default.
CODE_ALLOWED: dict[tuple[str, str], str] = {
    ("src/grpo/trainer/optim.py", "weight_decay"): "any optimizer's node: absent means no decay, not AdamW's 0.0",
}
SRC = Path(__file__).resolve().parents[1] / "src"


@functools.cache
def _schema_literals() -> dict[str, set]:
    """Each schema field name -> the (non-null) literal defaults the schemas give it."""
    out: dict[str, set] = {}
    for cls in (getattr(grpo.schema, name) for name in grpo.schema.__all__):
        if dataclasses.is_dataclass(cls):
            for field in dataclasses.fields(cls):
                if field.default is not dataclasses.MISSING and field.default is not None and field.name != "_target_":
                    out.setdefault(field.name, set()).add(_plain(field.default))
    return out


def literal_restatements(source: str, where: str) -> list[str]:
    """`option(cfg, "key", <literal>)` and `cfg.get("key", <literal>)` calls in `source` whose literal is a schema's
    default for that key: the code should read the schema (`ServerConfig.max_restarts`) or the typed config."""
    literals, out = _schema_literals(), []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id == "option" and len(args) == 3:
            key, default = args[1], args[2]
        elif isinstance(func, ast.Attribute) and func.attr == "get" and len(args) == 2:
            key, default = args
        else:
            continue
        if (isinstance(key, ast.Constant) and isinstance(default, ast.Constant) and key.value in literals
                and _plain(default.value) in literals[key.value] and (where, key.value) not in CODE_ALLOWED):
            out.append(f"{where}:{node.lineno}: {key.value} defaults to {default.value!r}, the schema's default")
    return out


def test_no_code_restates_a_schema_default():
    problems = [p for path in sorted(SRC.rglob("*.py"))
                for p in literal_restatements(path.read_text(), str(path.relative_to(SRC.parent)))]
    assert not problems, "read the schema's default (or the typed config) instead:\n" + "\n".join(problems)


def test_a_planted_literal_default_is_found():
    planted = 'limit = int(option(cfg.server, "max_restarts", 3))\nkeep = cfg.server.get("reuse_across_jobs", True)\n'
    found = literal_restatements(planted, "src/grpo/planted.py")
    assert sorted(p.split(": ")[1].split(" ")[0] for p in found) == ["max_restarts", "reuse_across_jobs"], found
    assert not literal_restatements('option(cfg.server, "max_restarts", ServerConfig.max_restarts)', "x.py")
