"""Every config group composes and every `_target_` instantiates (lightning-hydra-template style)."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from treegraft.config import CONF_DIR
from treegraft.data import BenchmarkConfig
from treegraft.decoding.methods import METHODS
from treegraft.decoding.tree_config import tree_config_from
from treegraft.models import PairSpec
from treegraft.settings import RunSettings

from .conftest import compose

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


DEFAULT_GROUPS = {"pair", "method", "paths", "tree", "engine", "placement", "small"}
# groups that only the pipeline's primary configs list (`evaluate` lists them all)
PIPELINE_GROUPS = {"pipeline", "scheduler", "evaluation", "logger", "experiment"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_expected_groups_exist():
    assert {"pair", "data", "method", "paths", "tree"} <= set(GROUPS)
    assert len(options("data")) == 6
    assert {"qwen-coder-1.5b__0.5b", "tiny-random", "smollm2-135m__self", "qwen-coder-1.5b__self",
            "qwen-coder-0.5b__self", "gemma3-270m__self", "qwen3-32b__0.6b"} <= set(options("pair"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_group_option_composes_and_instantiates(group, option):
    if group == "experiment":  # a global package: it overrides other groups
        cfg = compose("evaluate", [f"experiment={option}"])
        assert cfg.pipeline.name == option
        assert OmegaConf.to_container(cfg, resolve=True)
        return
    if group in PIPELINE_GROUPS:
        cfg = compose("evaluate", [f"{group}={option}"])
    else:
        prefix = "" if group in DEFAULT_GROUPS else "+"  # groups the primary config does not list are appended
        cfg = compose("generate", [f"{prefix}{group}={option}"])
    node = cfg[group]
    resolved = OmegaConf.to_container(node, resolve=True)  # every interpolation resolves
    assert resolved
    if "_target_" in node:
        obj = instantiate(node)
        expected = {"pair": PairSpec, "data": BenchmarkConfig}.get(group)
        if expected is not None:
            assert isinstance(obj, expected)
        if group == "pair":
            assert obj.name == option
    if group == "method":
        assert node.name == option and option in METHODS
    if group == "tree":
        tree = tree_config_from("all_small", resolved)
        assert tree.depth >= 1 and tree.ngram.max_n >= 1
    if group in ("tree", "small", "engine"):  # the one reader of these groups takes every option
        settings = RunSettings.of(cfg)
        assert settings.tree_config("all_small") == tree_config_from("all_small", OmegaConf.to_container(cfg.tree, resolve=True))
        if group == "small":
            assert settings.small == resolved
        if group == "engine":
            assert settings.engine.name == option
    if group == "placement":
        from treegraft.models.loading import placement_from

        assert placement_from(node).device_map == resolved["device_map"] and resolved["kv_tokens"] > 0


def test_an_unknown_tree_setting_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown tree setting 'bugdet'; expected one of .*budget"):
        tree_config_from("fixed", {"bugdet": 8})


def test_default_generate_config(cfg_generate):
    assert cfg_generate.method.name == "ar"
    assert cfg_generate.pair.name == "tiny-random"
    assert cfg_generate.temperature == 0.0


def test_benchmarks_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEGRAFT_BENCHMARKS", str(tmp_path))
    cfg = compose("generate", ["+data=gsm8k"])
    assert instantiate(cfg.data).benchmarks_dir == str(tmp_path)


@pytest.mark.parametrize("launcher,target", [("local", "LocalLauncher"), ("slurm", "SlurmLauncher")])
def test_submitit_launcher_configs_compose(launcher, target):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("evaluate", [f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    assert cfg.hydra.launcher.submitit_folder.endswith("/.submitit/%j")


@pytest.mark.parametrize("stage", ["collect", "fit", "distill", "evaluate", "report"])
def test_every_stage_config_composes_with_every_experiment(stage):
    for option in options("experiment"):
        cfg = compose(stage, [f"experiment={option}"])
        assert cfg.pipeline.name == option


def test_dataclass_defaults_equal_the_shipped_yaml():
    """One source of defaults: TreeConfig() (what the Python API gets) is the tree every table uses."""
    from dataclasses import asdict, fields

    from treegraft.decoding import TreeConfig

    shipped = OmegaConf.to_container(compose("generate", ["pair=tiny-random"]).tree, resolve=True)
    library = asdict(TreeConfig())
    library.pop("method")
    assert set(shipped) == set(library), "tree settings missing from conf/tree/default.yaml or from TreeConfig"
    for name in shipped:
        assert shipped[name] == library[name], (name, shipped[name], library[name])
    assert tree_config_from("fixed", shipped) == TreeConfig(method="fixed")
    paper = TreeConfig.paper()
    assert (paper.budget, paper.shape, paper.ngram.scoring, paper.ngram.copy_len) == (63, "paper", "target", 0)
    assert {f.name for f in fields(TreeConfig)} - {"method"} == set(shipped)
