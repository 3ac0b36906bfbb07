"""`--help`'s list of keys: every key of the composed config with its value and one line of description, the first
sentence of the comment written above its field in the typed schema (`grpo.schema`), or else above the key in the
group's shipped YAML (a key with no schema field of its own: a task's or a reward's); docs/configuring.md describes
each group in full."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from grpo.conf import CONFIG_DIR
from grpo.schema import RootConfig

# A description longer than this is cut at a word (the schema's comment and docs/configuring.md have the rest).
DESCRIPTION_CHARS = 100
FIELD = re.compile(r"^    (\w+)\s*:")
YAML_KEY = re.compile(r"^( *)(\w+):")


@cache
def field_descriptions(schema: type) -> dict[str, str]:
    """Each field of dataclass `schema` (and of its dataclass bases) -> the comment lines just above it, joined."""
    out: dict[str, str] = {}
    for klass in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):  # no source (a frozen build): keys without descriptions
            continue
        comment: list[str] = []
        for line in lines:
            stripped = line.strip()
            if stripped.startswith("#"):
                comment.append(stripped.lstrip("#").strip())
                continue
            field = FIELD.match(line)
            if field and comment:
                out[field.group(1)] = " ".join(comment)
            comment = []
    return out


@cache
def yaml_descriptions(path: Path) -> dict[str, str]:
    """Each key of YAML file `path` (dotted, `logging.wandb`) -> the comment lines just above it, joined."""
    out: dict[str, str] = {}
    parents: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        key = YAML_KEY.match(line)
        if key:
            indent = len(key.group(1))
            parents = [(i, k) for i, k in parents if i < indent]
            dotted = ".".join([*(k for _, k in parents), key.group(2)])
            if comment and not dotted.startswith("hydra"):
                out[dotted] = " ".join(comment)
            parents.append((indent, key.group(2)))
        comment = []
    return out


def group_descriptions(group: str, option: str | None) -> dict[str, str]:
    """The keys of a group described in its shipped YAML: the chosen option's file first, then the group's others,
    then the group's node in conf/train.yaml."""
    files = sorted((CONFIG_DIR / group).glob("*.yaml"), key=lambda f: f.stem != option)
    out = {k.removeprefix(f"{group}."): v for k, v in yaml_descriptions(CONFIG_DIR / "train.yaml").items()
           if k.startswith(f"{group}.")}
    for path in reversed(files):
        out.update(yaml_descriptions(path))
    return out


def one_line(description: str) -> str:
    """The first sentence of `description`, at most DESCRIPTION_CHARS characters."""
    sentence = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z`(])", description, maxsplit=1)[0]
    return textwrap.shorten(sentence, DESCRIPTION_CHARS, placeholder=" ...")


def _value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _line(indent: str, key: str, value: Any, description: str | None) -> str:
    text = f"{indent}{key}: {_value(value)}"
    return f"{text}    # {one_line(description)}" if description else text


def config_keys(*, _root_: DictConfig) -> str:
    """Every key of the composed job config (not `hydra`), its value unresolved and its description: the help
    template's resolver (`${grpo.config_keys:}`); `$` doubled, since Hydra reads the template as a string.Template."""
    plain = OmegaConf.to_container(_root_, resolve=False, enum_to_str=True)
    root_notes = field_descriptions(RootConfig)
    choices = plain.get("hydra", {}).get("runtime", {}).get("choices", {})
    groups, top = [], []
    for name, value in plain.items():
        if name == "hydra":
            continue
        if not isinstance(value, dict):
            top.append(_line("", name, value, root_notes.get(name)))
            continue
        schema = OmegaConf.get_type(_root_, name)
        notes = group_descriptions(name, choices.get(name))
        notes.update(field_descriptions(schema) if dataclasses.is_dataclass(schema) else {})
        groups += [f"{name}:", *(_line("  ", key, v, notes.get(key)) for key, v in value.items())]
    return "\n".join(groups + top).replace("$", "$$")
