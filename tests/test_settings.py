"""Config enters once, as objects: :class:`treegraft.settings.RunSettings` is the one reader of the ``tree`` and
``small`` groups; a bad setting is refused there in one line; evaluate's run keys and collect's runtime fields
are what they were when each stage read the config itself."""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from treegraft.decoding.tree_config import tree_config_from
from treegraft.front import EngineSettings
from treegraft.settings import RunSettings, tree_variant

from .conftest import REPO_ROOT, compose

BUILDER = REPO_ROOT / "src" / "treegraft" / "settings.py"
SOURCES = [REPO_ROOT / "src", REPO_ROOT / "scripts"]
GROUPS = ("tree", "small")
CONFIG = re.compile(r"(^|[.\w])(cfg|config)$")  # a Hydra config by the project's names: cfg, self.cfg, stage_cfg, config
GROUP_IN = re.compile(r"\.(tree|small)\b|[\[(]\s*['\"](tree|small)['\"]")


def _group_key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and node.value in GROUPS else None


def raw_reads(path: Path) -> list[str]:
    """``"<file>:<line>: <code>"`` for every read of a config's ``tree`` / ``small`` group (``cfg.tree``,
    ``cfg.get("small")``, ``cfg["tree"]``) and every ``to_container`` of one."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Attribute) and node.attr in GROUPS:
            hit = bool(CONFIG.search(ast.unparse(node.value)))
        elif isinstance(node, ast.Subscript) and _group_key(node.slice):
            hit = bool(CONFIG.search(ast.unparse(node.value)))
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "get" and isinstance(node.func, ast.Attribute) and node.args and _group_key(node.args[0]):
                hit = bool(CONFIG.search(ast.unparse(node.func.value)))
            elif name == "to_container" and node.args:
                hit = bool(GROUP_IN.search(ast.unparse(node.args[0])))
        if hit:
            found.append(f"{path}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_only_the_builder_reads_the_tree_and_small_groups():
    files = [p for root in SOURCES for p in sorted(root.rglob("*.py")) if p != BUILDER]
    assert [hit for p in files for hit in raw_reads(p)] == []


def test_the_check_catches_a_raw_read(tmp_path):
    bad = tmp_path / "stage.py"
    bad.write_text("from omegaconf import OmegaConf\n"
                   "def stage(cfg, self):\n"
                   "    tree = OmegaConf.to_container(cfg.tree, resolve=True)\n"
                   "    small = OmegaConf.to_container(cfg.small) if cfg.get('small') else None\n"
                   "    return int(cfg.tree.depth), self.cfg['tree'], str(stage_cfg.tree.budget)\n"
                   "def fine(decoder, engines, settings):\n"
                   "    return decoder.small, engines.small(1), settings.tree, OmegaConf.to_container(OmegaConf.load('x'))\n")
    hits = [h.split(": ", 1)[1] for h in raw_reads(bad)]
    assert "OmegaConf.to_container(cfg.tree, resolve=True)" in hits and "cfg.get('small')" in hits
    assert "OmegaConf.to_container(cfg.small)" in hits and "self.cfg['tree']" in hits and "stage_cfg.tree" in hits
    assert not any(h.startswith(("decoder.", "engines.", "settings.")) or "load(" in h for h in hits)


@pytest.mark.parametrize("override,message", [
    ("+tree.bugdet=8", r"unknown tree setting 'bugdet'; expected one of .*budget"),
    ("tree.shape=round", r"shape must be auto or paper, got 'round'"),
    ("+small.bogus=1", r"unknown small drafter setting 'bogus'"),
])
def test_a_bad_setting_is_refused_by_the_builder_in_one_line(override, message):
    cfg = compose("generate", ["pair=tiny-random", override])
    with pytest.raises(ValueError, match=message) as err:
        RunSettings.of(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [[], ["tree.budget=8", "tree.shape=paper"], ["small=self_draft"],
                                       ["engine=llama_cpp"]])
def test_the_settings_hold_the_groups_as_the_stages_read_them(overrides):
    cfg = compose("evaluate", ["experiment=smoke", *overrides])
    settings = RunSettings.of(cfg)
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    assert json.dumps(settings.tree) == json.dumps(tree)  # the same keys, values and order
    assert settings.small == (OmegaConf.to_container(cfg.small, resolve=True) if cfg.get("small") else None)
    assert settings.engine == EngineSettings.of(cfg)
    # collect's runtime.json and every record: what str(cfg.tree.budget) and cfg.tree.shape gave
    assert (settings.budget_setting, settings.tree_shape) == (str(cfg.tree.budget), cfg.tree.shape)
    assert settings.depth == int(cfg.tree.depth)
    assert settings.tree_config("fixed") == tree_config_from("fixed", tree)
    changed = settings.tree_with(schedule=[0] * settings.depth)
    assert changed["schedule"] == [0] * settings.depth and settings.tree == tree  # a copy; the settings stay
    assert pickle.loads(pickle.dumps(settings)) == settings  # handed to spawned GPU workers
    assert RunSettings.of(settings) is settings


def test_a_config_without_small_or_engine_groups():
    cfg = compose("bench_engine", ["pair=tiny-random"])
    settings = RunSettings.of(cfg)
    assert settings.small is None and settings.engine == EngineSettings()
    assert settings.small_for("fixed") is None and settings.small_for("fixed@self_draft")["name"] == "self_draft"
    assert tree_variant(settings.tree, ["ngram.copy_len=0"])["ngram"]["copy_len"] == 0
    assert settings.tree["ngram"]["copy_len"] != 0


# evaluate's run key as the stage computed it before RunSettings (its own reads of cfg.tree and cfg.small)
OLD_NOT_IN_RUN_KEY = ("methods", "benchmarks", "prompts_per_benchmark", "ablations", "ablation_prompts", "prompt_offset",
                      "target_half_width", "max_prompts_per_benchmark", "min_prompts_per_benchmark", "round_prompts",
                      "sensitivity", "sensitivity_prompts", "scheduler_from")


def _old_run_key(cfg, pair: str, method: str, artifacts: Path) -> str:
    from treegraft.decoding.methods import LEARNED_ARTIFACTS, method_small, parse_method, small_settings
    from treegraft.machine import machine_line
    from treegraft.pipeline.artifacts import file_hash

    e = OmegaConf.to_container(cfg.evaluation, resolve=True)
    for k in OLD_NOT_IN_RUN_KEY:
        e.pop(k, None)
    parts = {"pair": pair, "method": method, "evaluation": e,
             "tree": OmegaConf.to_container(cfg.tree, resolve=True), "dtype": cfg.pipeline.dtype,
             "runtime": cfg.runtime, "middle_runtime": cfg.middle_runtime, "cpu": machine_line([cfg.pipeline.device]),
             "device": cfg.pipeline.device, "warmup_tokens": cfg.pipeline.warmup_tokens,
             "warmup_repeats": cfg.pipeline.warmup_repeats}
    engine = asdict(EngineSettings.of(cfg))
    if engine["name"] != "torch":
        from treegraft.engines.llama_cpp.build import installed_build

        parts["engine"] = {**engine, "build": (installed_build() or {}).get("patch_id")}
    name = method_small(method)
    small = small_settings(name) if name else (OmegaConf.to_container(cfg.small, resolve=True) if cfg.get("small") else None)
    small = None if not small or small.get("name") == "ngram" else small
    if small is not None:
        parts["small"] = small
    base, _ = parse_method(method)
    if base in LEARNED_ARTIFACTS:
        parts["artifacts"] = {name: file_hash(artifacts / name) for name in LEARNED_ARTIFACTS[base]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize("overrides", [[], ["tree.budget=8", "tree.shape=paper", "tree.ngram.copy_len=0"],
                                       ["small=self_draft"], ["engine=llama_cpp"]])
def test_the_run_key_of_a_composed_config_is_unchanged(overrides, tmp_path):
    from treegraft.decoding.methods import LEARNED_ARTIFACTS
    from treegraft.pipeline.evaluate import run_key

    for files in LEARNED_ARTIFACTS.values():
        for name in files:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(name)
    cfg = compose("evaluate", ["experiment=smoke", *overrides])
    settings = RunSettings.of(cfg)
    for method in ("ar", "all_small", "fixed", "fixed@self_draft", "treegraft", "treegraft@t_mid_x1.25"):
        old = _old_run_key(cfg, "tiny-random", method, tmp_path)
        assert run_key(cfg, "tiny-random", method, tmp_path) == old, method
        assert run_key(cfg, "tiny-random", method, tmp_path, settings) == old, method
