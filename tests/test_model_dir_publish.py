"""Model directories in the shared cache are published atomically, and a build another process published first is
kept: two runs started together (a plan's wave, a parallel sweep) must not delete the directory the other loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.models.tiny import publish_model_dir


def _complete(path: Path) -> bool:
    return (path / "config.json").exists()


def test_a_build_published_meanwhile_by_another_process_is_kept(tmp_path):
    final = tmp_path / "cache" / "model-abc"

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text("mine")
        # Meanwhile another process publishes the same build under the final name (and is loading it).
        final.mkdir(parents=True)
        (final / "config.json").write_text("theirs")

    assert publish_model_dir(final, write, complete=_complete) == final
    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in final.parent.iterdir()] == ["model-abc"]  # this process's copy is gone


def test_an_incomplete_directory_is_replaced_and_nothing_half_built_is_left(tmp_path):
    final = tmp_path / "model-abc"
    final.mkdir()
    (final / "model.safetensors").write_text("partial")  # an older, interrupted build: no config.json

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text("new")

    publish_model_dir(final, write, complete=_complete)
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["model-abc"]


def test_a_failed_write_leaves_no_temporary_directory(tmp_path):
    final = tmp_path / "model-abc"

    def write(tmp: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_model_dir(final, write, complete=_complete)
    assert list(tmp_path.iterdir()) == []
