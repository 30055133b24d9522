"""Shared fixtures: a composed Hydra config, the tiny random pair, and embedded-model guards."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Nothing may be downloaded from a hub in tests: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_MODE", "offline")
# per-machine measurements (runtime=auto, verification curves) go to a fresh folder, not outputs/cache
os.environ.setdefault("TREEGRAFT_CACHE", tempfile.mkdtemp(prefix="treegraft-cache-"))
# CI points TREEGRAFT_BENCHMARKS at ../shared/data/benchmarks; do the same when it is unset here.
_shared_benchmarks = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"
if "TREEGRAFT_BENCHMARKS" not in os.environ and _shared_benchmarks.is_dir():
    os.environ["TREEGRAFT_BENCHMARKS"] = str(_shared_benchmarks)

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers: one core each, no oversubscription
    import torch

    torch.set_num_threads(1)
    # each worker on a core of its own, so what sizes itself by the cores it may use (llama.cpp's
    # threads=auto) takes one: two workers of two spinning llama.cpp threads each on two cores made the
    # llama.cpp tests several times slower
    if hasattr(os, "sched_setaffinity"):
        _cores = sorted(os.sched_getaffinity(0))
        _index = int(os.environ["PYTEST_XDIST_WORKER"].lstrip("gw") or 0)
        if len(_cores) > 1:
            os.sched_setaffinity(0, {_cores[_index % len(_cores)]})

from treegraft.config import CONF_DIR  # noqa: E402  (registers the OmegaConf resolvers)
from treegraft.models.embedded import EMBEDDED_MODELS, is_converted  # noqa: E402
from treegraft.paths import default_models_dir  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def compose(config_name: str, overrides: list[str] | None = None):
    """The config an entry point would see for these command-line overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


@pytest.fixture
def cfg_generate():
    """The composed `generate` config on the tiny pair (what `python -m treegraft.generate pair=tiny-random` sees)."""
    return compose("generate", ["pair=tiny-random"])


def require_embedded(name: str) -> Path:
    """The converted folder of an embedded model; skip locally, fail in CI, when it is missing."""
    folder = default_models_dir() / name
    if not is_converted(folder, EMBEDDED_MODELS[name]):
        message = f"embedded model {name} not converted: run `make models MODELS={name}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


@pytest.fixture(scope="session")
def tiny_pair():
    from treegraft.models import PairSpec, load_pair

    return load_pair(PairSpec(name="tiny-random", target="tiny-random:0", middle="tiny-random:1"))


@pytest.fixture(scope="session")
def smollm2_self_pair():
    from omegaconf import OmegaConf
    from hydra.utils import instantiate

    from treegraft.models import load_pair

    require_embedded("smollm2-135m")
    spec = instantiate(OmegaConf.load(CONF_DIR / "pair" / "smollm2-135m__self.yaml"))
    return load_pair(spec)


def tree_decoder(target, middle, tokenizer=None, cfg=None, sampling=None, **kwargs):
    """A tree decoder of ``cfg`` (a TreeConfig) over PyTorch models, through the front door."""
    from treegraft.decoding import TreeConfig
    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for

    cfg = cfg or TreeConfig()
    return decoder_for(cfg.method, TorchEngines(target, middle, tokenizer), cfg, sampling, **kwargs)


def ar_decoder(model, eos_ids=None, sampling=None):
    """``ar`` over a PyTorch model, through the front door."""
    from treegraft.engines.torch import TorchEngines
    from treegraft.front import decoder_for

    return decoder_for("ar", TorchEngines(model), sampling=sampling, eos_ids=eos_ids)
