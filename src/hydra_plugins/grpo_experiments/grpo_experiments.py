"""`experiment=<name>` composes `experiments/<name>.yaml`: a config source that shows the experiments directory to
Hydra as the one group `experiment`, and a search-path plugin that puts it right after the shipped config tree
whenever that tree is on the search path (`grpo-train`, `python train.py`, and compose() on grpo.conf.CONFIG_DIR).

Hydra finds a group only as a sub-directory named like the group, and the experiments sit beside conf/, not in it
(the repository's promised layout), so a plain search-path entry cannot do it. A `--config-dir` of your own still
adds experiments the usual way (its `experiment/` folder), ahead of the shipped ones.
"""

# No `from __future__ import annotations`: Hydra loads plugin modules outside the usual import.
import os
from typing import List, Optional

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from grpo.conf import CONFIG_DIR, EXPERIMENT_GROUP, EXPERIMENTS_DIR

SCHEME = "grpo-experiments"


class ExperimentsConfigSource(ConfigSource):
    """A directory of YAML files (`grpo-experiments://<dir>`) as the config group `experiment`: `experiment/<name>`
    is `<dir>/<name>.yaml`; nothing else is in it."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _file(self, config_path: str) -> Optional[str]:
        """The path under the directory that `config_path` names, None for one outside the group."""
        if config_path == EXPERIMENT_GROUP:
            return self.path
        prefix = EXPERIMENT_GROUP + "/"
        return os.path.join(self.path, config_path[len(prefix):]) if config_path.startswith(prefix) else None

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(self._normalize_file_name(config_path))
        if path is None or not os.path.isfile(path):
            raise ConfigLoadError(f"Config not found : {config_path} (in {self.full_path()})")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ConfigResult(config=OmegaConf.create(text) if text.strip() else OmegaConf.create(),
                            path=self.full_path(), provider=self.provider, header=self._get_header_dict(text))

    def available(self) -> bool:
        return os.path.isdir(self.path)

    def is_group(self, config_path: str) -> bool:
        path = self._file(config_path)
        return (config_path == "" and self.available()) or (path is not None and os.path.isdir(path))

    def is_config(self, config_path: str) -> bool:
        path = self._file(self._normalize_file_name(config_path))
        return path is not None and os.path.isfile(path)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        if config_path == "":
            wanted = results_filter in (None, ObjectType.GROUP) and self.available()
            return [EXPERIMENT_GROUP] if wanted else []
        path = self._file(config_path)
        files: List[str] = []
        for name in sorted(os.listdir(path)) if path is not None and os.path.isdir(path) else []:
            self._list_add_result(files=files, file_path=f"{config_path}/{name}", file_name=name,
                                  results_filter=results_filter)
        return sorted(set(files))


class ExperimentsSearchPath(SearchPathPlugin):
    """Adds the shipped experiments right after the shipped config tree, when the search path has that tree."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        shipped = {str(CONFIG_DIR), f"file://{CONFIG_DIR}", "pkg://grpo.conf", "pkg://grpo/conf"}
        for element in search_path.get_path():
            if element.path in shipped:
                search_path.append(SCHEME, f"{SCHEME}://{EXPERIMENTS_DIR}",
                                   anchor=SearchPathQuery(provider=element.provider, path=element.path))
                return
