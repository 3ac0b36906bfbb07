"""Checks of the command line before Hydra composes it: the config dirs it names exist, a choice that needs a Hydra
plugin has it, each `group=option` names an option and each `key=value` a key the config has, with a value its type
takes. Hydra's own errors for these name no fix (or, for a misspelt key, suggest `+key=...`, which adds a key
nothing reads). Each raises ConfigError; `check_command_line` runs them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from grpo.conf import group_dir, group_names
from grpo.config_values import ConfigError
from grpo.schema import EvalConfig, RootConfig

# Flags that add a config directory to Hydra's search path (`--config-dir DIR`, `-cd DIR`, `--config-dir=DIR`).
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
# Flags that give another primary config than the shipped train.yaml.
CONFIG_PATH_FLAGS = ("--config-path", "-cp")


def check_command_line(args: Sequence[str], shipped_config_dir: Path) -> None:
    """Every check of this module on the trainer's arguments (`sys.argv[1:]`), before Hydra composes."""
    check_hydra_plugins(args)
    dirs = config_dirs(args)
    check_config_dirs(dirs)
    if not any(a.split("=", 1)[0] in CONFIG_PATH_FLAGS for a in args):  # another primary config: Hydra checks it
        check_group_option_names(args, [shipped_config_dir, *dirs])
    else:
        check_saved_config_overrides(args, shipped_config_dir)


def _flag_value(args: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the first of `flags` (`--flag VALUE` or `--flag=VALUE`), None when none is given."""
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name in flags:
            return value if sep else (args[i + 1] if i + 1 < len(args) else None)
    return None


def check_saved_config_overrides(args: Sequence[str], shipped_config_dir: Path) -> None:
    """`group=option` beside `--config-path <run>/.hydra --config-name config` (rerunning a run's saved config): that
    config is composed already (no defaults list), so Hydra refuses the choice with "Could not override 'eval'. No
    match in the defaults list", and its advice (`+eval=off`) fails too. Said here, with what works instead."""
    path, name = _flag_value(args, CONFIG_PATH_FLAGS), _flag_value(args, ("--config-name", "-cn"))
    primary = Path(path or ".") / f"{(name or 'config').removesuffix('.yaml')}.yaml"
    if path is None or not primary.is_file() or "defaults" in (OmegaConf.load(primary) or {}):
        return
    groups = group_names(shipped_config_dir)
    for arg in args:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key in groups and not arg.startswith("-"):
            raise ConfigError(
                f"{arg}: {primary} is a saved config, composed already (it has no defaults list), so no option of "
                f"{key} can be chosen on it; set the keys of {key} instead ({key}.<key>=<value>: eval=off is "
                f"eval.enabled=false), or compose anew from the shipped config with the run's own overrides"
            )


def config_dirs(args: Sequence[str]) -> list[Path]:
    """The directories `--config-dir` / `-cd` add to the search path."""
    dirs = []
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in CONFIG_DIR_FLAGS:
            dirs.append(Path(value or (args[i + 1] if i + 1 < len(args) else "")))
    return dirs


def rank_hydra_args() -> list[str]:
    """Arguments a torchrun rank > 0 adds to its command line: its Hydra run dir and logs stay out of the run (rank 0
    owns them)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra.output_subdir=null", f"hydra.run.dir={tempfile.gettempdir()}/grpo_rank{os.environ['RANK']}",
            "hydra/job_logging=stdout"]


# Command-line choices that need a Hydra plugin: (group, option) -> (its module, the pip package).
PLUGIN_CHOICES = {
    ("sweep", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    ("hydra/launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    ("hydra/launcher", "submitit_local"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
}


def command_name() -> str:
    """How the user started the trainer, for the commands a message suggests: the console script (`grpo-train`),
    else `python train.py`."""
    first = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "grpo-train" if first == "grpo-train" else "python train.py"


def module_dirs(args: Sequence[str]) -> list[str]:
    """The folders whose modules a run imports besides the working directory's: the one holding each --config-dir
    (an example's `my_rewards.py` beside its `conf/`)."""
    return [str(d.expanduser().resolve().parent) for d in config_dirs(args)]


def check_config_dirs(config_dirs: Sequence[Path]) -> None:
    """Each `--config-dir` is a directory: Hydra's own word for a missing one ("Additional config directory ... not
    found") came after ours for its first option ("experiment=my_task is not one of the experiment options"), and
    a relative one is looked up from the working directory, which is not the checkout for `grpo-train`."""
    for path in config_dirs:
        if not path.is_dir():
            where = "" if path.is_absolute() else f" (a relative path starts at the working directory, {Path.cwd()})"
            raise ConfigError(f"--config-dir {path}: no such directory{where}; give the directory that holds your "
                              "config groups (e.g. experiment/, data/)")


def check_hydra_plugins(args: Sequence[str]) -> None:
    """A command-line choice that needs a Hydra plugin (`sweep=optuna`) has it installed. Checked on the arguments,
    before Hydra composes: without the plugin Hydra stops with "Could not find 'hydra/sweeper/optuna'", which does
    not say what to install."""
    for arg in args:
        group, _, option = arg.lstrip("+~").partition("=")
        plugin = PLUGIN_CHOICES.get((group, option))
        if plugin is None:
            continue
        try:
            found = importlib.util.find_spec(plugin[0]) is not None
        except ModuleNotFoundError:  # no hydra_plugins package at all
            found = False
        if not found:
            raise ConfigError(f"{arg} needs Hydra's {plugin[1]} plugin, which is not installed: "
                              f"pip install -e \".[sweep]\" (or pip install {plugin[1]})")


def check_group_option_names(args: Sequence[str], config_dirs: Sequence[Path]) -> None:
    """Each `group=option` on the command line names an option of that group (a YAML file in a config dir's
    `<group>/`; the shipped experiments: experiments/), and each `key=value` a key the config has (`check_override_key`). Checked before Hydra composes:
    Hydra's own error for a typo (`optimizer=adamW`) lists the schema entries beside the options and its search
    path, with no suggestion."""
    chosen = _default_groups(config_dirs[0] / "train.yaml") if config_dirs else set()
    for arg in args:
        key, sep, value = arg.lstrip("+").partition("=")
        dirs = [group_dir(d, key) for d in config_dirs if key and group_dir(d, key).is_dir()] \
            if sep and not arg.startswith("-") else []
        if dirs and arg.startswith("+") and not arg.startswith("++") and key in chosen:
            # Hydra: "Multiple values for experiment. To override a value use 'override experiment: ...'" (YAML
            # syntax, no command line); `+experiment=x` is the usual form in other Hydra projects.
            raise ConfigError(f"{arg}: the config's defaults (conf/train.yaml) already choose an option of {key}, "
                              f"and + cannot add a second; pick this one without the +: {key}={value}")
        if not dirs and sep and not arg.startswith(("-", "+", "~")):
            check_override_key(key, value, config_dirs)
        if not dirs or any(c in value for c in "()[]{}$"):  # not a group of ours, or a sweep's function syntax
            continue
        options = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
        for choice in value.split(","):
            if choice in ("", "null") or choice in options or choice.endswith("_schema"):  # schemas: checked later
                continue
            close = difflib.get_close_matches(choice, options, n=1)
            hint = f"did you mean {key}={close[0]}? " if close else _config_dir_hint(key, choice)
            raise ConfigError(f"{key}={choice} is not one of the {key} options; {hint}choose one of {', '.join(options)} "
                              f"({command_name()} --help lists every group)")


def _config_dir_hint(group: str, option: str) -> str:
    """Where `<group>/<option>.yaml` lies below the working directory (up to 3 levels: examples/my_task/conf), said
    as the --config-dir that adds it: the README's own task runs with one, and leaving it out is an easy slip."""
    for depth in range(4):
        found = sorted(Path().glob("/".join(["*"] * depth + [group, f"{option}.yaml"])))
        if found:
            return (f"{found[0]} has it, but the config is not searched there: add --config-dir "
                    f"{found[0].parent.parent}; otherwise ")
    return ""


def _default_groups(primary: Path) -> set[str]:
    """The groups the primary config's defaults list chooses (`- model: tiny_qwen2`, `- sweep: null`, ...)."""
    if not primary.is_file():
        return set()
    defaults = OmegaConf.load(primary).get("defaults") or []
    return {str(k).removeprefix("override ") for d in defaults if OmegaConf.is_dict(d) for k in d.keys()}


def check_override_key(key: str, value: str, config_dirs: Sequence[Path]) -> None:
    """`key=value` (no `+`) sets a key the config has: its first part is a top-level key or a group of a config
    dir, and under a node of a fixed schema (train, model, server, eval, ...) the next part is one of its fields.
    Hydra's own error for a misspelt key (`optimzer.lr=1`) advises `+optimzer.lr=1`, which adds a key nothing reads."""
    # Groups typed Any in RootConfig whose shipped options all build on one schema: checked against it unless a
    # config dir of the user's adds options to the group (which may build on another).
    shared = {"eval": EvalConfig}
    parts = key.split(".")
    if "/" in key or not all(parts):  # hydra/launcher=..., or not a dotted key
        return
    schema: Any = RootConfig
    groups = {g for c in config_dirs if c.is_dir() for g in group_names(c)}
    for depth, part in enumerate(parts):
        if schema is None or not dataclasses.is_dataclass(schema):
            return  # a node whose keys depend on the option chosen (optimizer, mode, data, ...): Hydra checks it
        if depth == 0 and (part == "hydra" or part in groups):
            if part == "hydra" or part not in {f.name for f in dataclasses.fields(schema)}:
                return  # Hydra's own node, or a group of your config dir
        hints = typing.get_type_hints(schema)
        if part not in hints:
            where = ".".join(parts[:depth + 1])
            close = difflib.get_close_matches(part, sorted(hints), n=1)
            fix = ".".join([*parts[:depth], close[0], *parts[depth + 1:]]) if close else None
            hint = f"did you mean {fix}={value}? " if fix else ""
            raise ConfigError(f"{key}={value}: the config has no key {where}; {hint}({command_name()} --cfg job prints "
                              "every key; +key=... would add a key nothing reads)")
        parent, schema = schema, hints[part]
        if depth == 0 and part in shared and not any((c / part).is_dir() for c in config_dirs[1:]):
            schema = shared[part]
    if not dataclasses.is_dataclass(schema):
        check_override_type(key, value, parent, parts[-1])


def check_override_type(key: str, value: str, schema: Any, field: str) -> None:
    """`key=value` whose value the schema field's type cannot take (`train.steps=many`): Hydra's own error is its
    "Error merging override" block and a HYDRA_FULL_ERROR hint. Each value of a sweep's list (`train.steps=2,many`)
    is checked alike; range and interval sweeps and interpolations are left to Hydra."""
    try:
        override = OverridesParser.create().parse_override(f"{key}={value}")
    except Exception:  # noqa: BLE001 - Hydra's parser says what is wrong with the syntax itself
        return
    if "$" in value or (override.is_sweep_override() and not override.is_discrete_sweep()):
        return
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    node = OmegaConf.structured(schema)
    for one in values:
        try:
            setattr(node, field, one)
        except ValidationError as e:
            why = str(e).splitlines()[0]  # the rest: OmegaConf's full_key / object_type lines
            raise ConfigError(f"{key}={one}: {why} ({command_name()} --cfg job prints every key and its value)") from None
