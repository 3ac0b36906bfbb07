"""Where the shipped configs lie. In the checkout they are the files at its root: `conf/` (train.yaml, Hydra's
primary config, and its groups: mode/, model/, optimizer/, ...) and `experiments/` (committed runs, Hydra's group
`experiment`). A wheel's build copies both into this package (grpo/conf/, grpo/experiments/), so that `grpo-train`
composes the same files outside the checkout. The Hydra plugin hydra_plugins.grpo_experiments shows EXPERIMENTS_DIR
to Hydra as the group `experiment` of CONFIG_DIR (docs/architecture.md, "The config tree")."""

from pathlib import Path

# The group under which Hydra composes the files of EXPERIMENTS_DIR (`experiment=<name>` on the command line).
EXPERIMENT_GROUP = "experiment"

_PACKAGE = Path(__file__).resolve().parent
if (_PACKAGE / "train.yaml").is_file():  # an installed wheel: the build copied both trees into the package
    CONFIG_DIR = _PACKAGE
    EXPERIMENTS_DIR = _PACKAGE.parent / "experiments"
else:  # the checkout (src/ on the path, or an editable install): the files at its root
    CONFIG_DIR = _PACKAGE.parents[2] / "conf"
    EXPERIMENTS_DIR = _PACKAGE.parents[2] / "experiments"


def group_dir(config_dir: Path, group: str) -> Path:
    """The directory holding config dir `config_dir`'s options of `group`: `<config_dir>/<group>/`, except the
    shipped experiments, which lie in EXPERIMENTS_DIR."""
    if group == EXPERIMENT_GROUP and config_dir == CONFIG_DIR:
        return EXPERIMENTS_DIR
    return config_dir / group


def group_names(config_dir: Path) -> set[str]:
    """The config groups of config dir `config_dir` (its sub-directories; the shipped one's with `experiment`)."""
    names = {d.name for d in config_dir.iterdir() if d.is_dir() and d.name != "__pycache__"}
    return (names | {EXPERIMENT_GROUP}) if config_dir == CONFIG_DIR else names
