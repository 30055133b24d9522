"""Targets over several devices and a middle drafter on its own: accelerate's placement (device_map,
max_memory, CPU/disk offload with its hooks in the path) decodes every method to `ar`'s output, and a
pair that cannot fit the memory given is refused in one line before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from treegraft.engines.torch import TorchTarget
from treegraft.front import decoder_for
from treegraft.devices import input_device, model_devices, output_device
from treegraft.models import PairSpec, load_pair
from treegraft.models.loading import placement_from
from treegraft.models.placement import (HUB_SHAPES, PairDoesNotFitError, Placement, check_fits, estimate_pair_memory,
                                        model_config, parameter_count, parse_bytes)
from treegraft.models.tiny import build_tiny_model, build_tiny_tokenizer

from .conftest import REPO_ROOT
from .conftest import ar_decoder
from treegraft.engines.torch import TorchEngines

PROMPT = list(range(5, 45)) + list(range(5, 25))
METHODS = ["ar", "all_small", "all_mid", "fixed", "csd", "hf_assisted"]
GPUS_NEEDED = {"llama3.3-70b__3.1-8b": 3, "llama3.3-70b__3.2-1b": 2, "llama3.3-70b__3.2-3b": 2, "qwen3-32b__8b": 2}
PAPER_PAIRS = sorted(p.stem for p in (REPO_ROOT / "conf" / "pair").glob("*.yaml")
                     if "hub" in (OmegaConf.load(p).get("tags") or []))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The tiny random target as a checkpoint folder, so loading goes through from_pretrained(device_map=...)."""
    folder = tmp_path_factory.mktemp("tiny0")
    build_tiny_model(0).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("placement", [
    # most of the target on disk: accelerate's hooks load the layers, the norm and the LM head per forward
    {"device_map": "auto", "max_memory": {"cpu": "300KB", "disk": "1GB"}},
    # an explicit map: the first layer in memory, the rest and the head offloaded; the middle spread by accelerate
    {"device_map": {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                    "model.rotary_emb": "cpu", "lm_head": "disk"}, "max_memory": {"cpu": "1GB", "disk": "1GB"},
     "middle": "auto"},
])
def test_an_offloaded_target_decodes_every_method_to_ar(tiny_pair, tiny_folder, tmp_path, placement):
    reference = ar_decoder(tiny_pair.target).generate(PROMPT, 24).tokens
    pair = load_pair(PairSpec(name="tiny-offloaded", target=str(tiny_folder), middle="tiny-random:1"),
                     placement=Placement(**placement, offload_folder=str(tmp_path / "offload")))
    assert "disk" in set(pair.target.hf_device_map.values())
    assert hasattr(pair.target.lm_head, "_hf_hook") and pair.target.lm_head.weight.device.type == "meta"
    assert input_device(pair.target) == output_device(pair.target) == torch.device("cpu")
    for method in METHODS:
        for draft_vocab in (None, 64):
            dec = decoder_for(method, TorchEngines(pair.target, pair.middle, tiny_pair.tokenizer), {"draft_vocab": draft_vocab})
            assert dec.generate(PROMPT, 24).tokens == reference, (method, draft_vocab)


@pytest.mark.parametrize("pair_name", PAPER_PAIRS)
def test_each_paper_pair_is_refused_in_one_line_when_too_large_without_reading_weights(pair_name, monkeypatch):
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight or tokenizer file was read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_reading)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_reading)
    spec = instantiate(OmegaConf.load(REPO_ROOT / "conf" / "pair" / f"{pair_name}.yaml"))
    estimate = estimate_pair_memory(spec, torch.bfloat16, 4096)
    small = Placement(device_map="auto", max_memory={0: "16GiB"})
    with pytest.raises(PairDoesNotFitError) as err:
        load_pair(spec, dtype="bfloat16", device="cuda", placement=small)
    message = str(err.value)
    assert "\n" not in message and f"needs {int(estimate.total * 1.1) / 1e9:.1f} GB" in message
    assert "17.2 GB is available" in message and pair_name in message
    # the fewest 80 GiB GPUs (A100/H100 80GB) that hold the pair in bfloat16 with a 4096-token KV cache (x1.1): the 70B targets
    # need two (141 GB of weights), three with the 8B middle; Qwen3-32B with Qwen3-8B does not fit one
    gpus = GPUS_NEEDED.get(pair_name, 1)
    check_fits(spec, torch.bfloat16, "cuda", Placement("auto", {i: "80GiB" for i in range(gpus)}), 4096)
    if gpus > 1:
        with pytest.raises(PairDoesNotFitError):
            check_fits(spec, torch.bfloat16, "cuda", Placement("auto", {i: "80GiB" for i in range(gpus - 1)}), 4096)


def test_the_estimates_count_the_published_parameters():
    # Qwen3-32B: 32.8B parameters; Llama-3.3-70B: 70.6B; Qwen3-0.6B (tied head): 0.6B
    for source, params in [("Qwen/Qwen3-32B", 32.76e9), ("meta-llama/Llama-3.3-70B-Instruct", 70.55e9),
                           ("Qwen/Qwen3-0.6B", 0.596e9), ("meta-llama/Llama-3.2-1B-Instruct", 1.236e9)]:
        assert parameter_count(model_config(source)) == pytest.approx(params, rel=0.01), source
    assert set(HUB_SHAPES) >= {OmegaConf.load(p).target for p in (REPO_ROOT / "conf" / "pair").glob("*.yaml")
                               if "hub" in (OmegaConf.load(p).get("tags") or [])}
    # Qwen3-32B in bfloat16 is about 65.5 GB of weights, Llama-3.3-70B about 141 GB
    assert estimate_pair_memory(PairSpec(name="q", target="Qwen/Qwen3-32B", middle="Qwen/Qwen3-8B"), torch.bfloat16,
                                0).target_weights == pytest.approx(65.5e9, rel=0.01)


def test_placement_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match="device_map must be auto, balanced"):
        Placement(device_map="everywhere")
    with pytest.raises(ValueError, match="middle placement must be same, auto or a device"):
        Placement(middle="gpu two")
    with pytest.raises(ValueError, match="bad memory size 'lots'"):
        parse_bytes("lots")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert Placement(max_memory={"cuda:1": "4GB", 0: "2GB", "cpu": "8GB"}).accelerate_memory() == {1: "4GB", 0: "2GB",
                                                                                                    "cpu": "8GB"}
    cfg = OmegaConf.create({"device_map": "auto", "max_memory": {"0": "70GiB", "cpu": "200GiB"}, "middle": "cuda:1"})
    assert placement_from(cfg) == Placement("auto", {"0": "70GiB", "cpu": "200GiB"}, "cuda:1")
    assert placement_from(None) == Placement()


def test_flash_attention_is_refused_in_one_line(tiny_pair):
    model = build_tiny_model(0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot run a tree mask"):
        TorchTarget(model, lambda k, v: torch.arange(k, device="cpu"))
    with pytest.raises(ValueError, match="cannot run a tree mask"):
        decoder_for("fixed", TorchEngines(tiny_pair.target, model, tiny_pair.tokenizer))


def test_a_split_model_names_every_device_it_computes_on(monkeypatch):
    model = build_tiny_model(0)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    devices = model_devices(model)
    assert torch.device("cuda", 0) in devices and torch.device("cuda", 1) in devices
