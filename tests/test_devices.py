"""Device-correct by construction, checked on a CPU: no host tensor meets a model tensor in the hot
path, every tensor factory there names its device, every timed region reads the clock that waits for
the models' devices, and a turn reads the device back at most a few times."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch

from tests.device_provenance import DeviceProvenance
from treegraft import devices
from treegraft.decoding import SamplingConfig
from treegraft.front import decoder_for
from treegraft.hostreads import count_host_reads
from treegraft.scheduling.learned import LearnedScheduler, MarginPredictor
from treegraft.scheduling.signals import REFERENCE_SIGNALS
from .conftest import ar_decoder
from treegraft.engines.torch import TorchEngines

SRC = Path(__file__).resolve().parents[1] / "src" / "treegraft"
# the decoder's hot path: every module a generation runs through between prefill and the last token
# (the scheduler's offline fitting, scheduling/value.py, is not on it)
HOT_PATH = sorted(p for p in [*SRC.glob("decoding/*.py"), *SRC.glob("decoding/builders/*.py"), *SRC.glob("drafters/*.py"),
                              *SRC.glob("engines/*.py"), *SRC.glob("engines/torch/*.py"), *SRC.glob("tree/*.py"),
                              *SRC.glob("scheduling/*.py"), SRC / "model_io.py", SRC / "front.py"]
                  if p.name != "value.py")
# (the *_like factories take their input's device)
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint",
             "randperm", "eye", "linspace"}
PROMPT = list(range(5, 45)) + list(range(5, 25))  # a repeat, so the n-gram drafter proposes


def learned_scheduler(depth: int = 5, seed: int = 0) -> LearnedScheduler:
    """A distilled scheduler with random weights (it calls at some steps and not others)."""
    return LearnedScheduler(MarginPredictor.untrained(depth, list(REFERENCE_SIGNALS), seed=seed))


def decoder(pair, method: str, **tree):
    scheduler = learned_scheduler() if method == "treegraft" else None
    return decoder_for(method, TorchEngines(pair.target, pair.middle, pair.tokenizer), tree, scheduler=scheduler)


# ---------------------------------------------------------------- where tensors live
@pytest.mark.parametrize("draft_vocab", [None, 64])
@pytest.mark.parametrize("method", ["ar", "all_small", "all_mid", "fixed", "csd", "treegraft"])
def test_no_host_tensor_meets_a_model_tensor(tiny_pair, method, draft_vocab):
    """The CPU stand-in for CUDA's device check (device_provenance): before the fix, the default prefill's
    vocabulary index (``head.subset.ids[i]``) and, with a draft vocabulary, ``TokenLogProbs.topk``
    (``self.ids[idx]``) indexed a host tensor with a model tensor, which stops a CUDA run at prefill."""
    dec = decoder(tiny_pair, method, draft_vocab=draft_vocab)
    with DeviceProvenance() as provenance:
        out = dec.generate(PROMPT, 24)
    assert provenance.violations == []
    assert out.tokens == ar_decoder(tiny_pair.target).generate(PROMPT, 24).tokens


def test_provenance_check_catches_a_host_index_into_model_output(tiny_pair):
    """The check can fail: the old prefill's pattern is flagged, the fixed one is not."""
    logits = tiny_pair.target.lm_head(torch.randn(3, tiny_pair.target.config.hidden_size))
    with DeviceProvenance() as provenance:
        host_ids = torch.arange(logits.shape[-1])  # no device: born on the host
        _, i = logits.topk(2, dim=-1)
        host_ids[i]
    assert len(provenance.violations) == 1 and "__getitem__" in provenance.violations[0]
    with DeviceProvenance() as provenance:
        ids = torch.arange(logits.shape[-1], device=logits.device)
        ids[logits.topk(2, dim=-1).indices]
    assert provenance.violations == []


def _factory_calls_without_device(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords):
            bad.append(f"{path.relative_to(SRC)}:{node.lineno} torch.{node.func.attr}")
    return bad


def test_hot_path_tensor_factories_name_their_device():
    """No tensor factory in the hot path without an explicit ``device=`` (host data says ``device="cpu"``;
    host lists reach a model's device through ``treegraft.devices.device_tensor``)."""
    assert HOT_PATH and SRC / "decoding" / "tree_decoder.py" in HOT_PATH
    bad = [b for path in HOT_PATH for b in _factory_calls_without_device(path)]
    assert bad == []


def test_the_factory_check_can_fail(tmp_path):
    src = SRC / "probe_factory.py"
    src.write_text("import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device='cpu')\n")
    try:
        assert _factory_calls_without_device(src) == ["probe_factory.py:2 torch.zeros"]
    finally:
        src.unlink()


# ---------------------------------------------------------------- one clock, synchronized
def test_no_clock_but_the_synchronizing_one():
    """``time.perf_counter`` / ``monotonic`` / ``process_time`` are read in ``treegraft/devices.py`` only:
    every other timed region goes through ``Clock.now`` (or ``devices.now`` for host-only work)."""
    clocks = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time"}
    bad = []
    for path in SRC.rglob("*.py"):
        if path.name == "devices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in clocks:
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} {node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "time" and any(a.name in clocks for a in node.names):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} from time import")
    assert bad == []


@pytest.mark.parametrize("method", ["ar", "all_small", "fixed", "csd", "treegraft"])
def test_every_clock_read_waits_for_the_models_devices(tiny_pair, method, monkeypatch):
    """With the models pretending to sit on a CUDA device as well, every clock read during a generation
    (and the warm-up that sets the scheduler's runtime context) is preceded by a synchronization of that
    device: a duration that feeds a record, a feature, a cost curve or a planner covers the GPU work."""
    fake = torch.device("cuda", 7)
    real = devices.model_devices
    monkeypatch.setattr(devices, "model_devices", lambda model: (*real(model), fake))
    events = []
    monkeypatch.setattr(devices, "_sync_one", lambda device: events.append(("sync", device)))
    perf_counter = time.perf_counter

    def clock_read():
        events.append(("read", None))
        return perf_counter()

    dec = decoder(tiny_pair, method)
    monkeypatch.setattr(devices.time, "perf_counter", clock_read)
    if method == "treegraft":
        dec.warm_up(PROMPT, 6)
    dec.generate(PROMPT, 16)
    monkeypatch.undo()
    reads = [i for i, (kind, _) in enumerate(events) if kind == "read"]
    assert len(reads) >= (3 if method == "ar" else 20)
    assert all(i > 0 and events[i - 1] == ("sync", fake) for i in reads)


def test_records_and_cache_keys_name_the_gpu(monkeypatch):
    from treegraft.models.runtime import runtime_cache_key

    assert devices.device_info(["cpu"]) == {} and devices.device_line(["cpu"]) == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "_cuda_names", lambda: ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    info = devices.device_info(["cuda:0", "cuda:1", "cpu"])
    assert info == {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 2, "cuda": "12.8"}
    assert devices.device_line(["cuda:0", "cuda:1"]) == "NVIDIA H100 80GB HBM3 x2 | CUDA 12.8"
    assert "NVIDIA H100 80GB HBM3 x1" in runtime_cache_key("model", "cuda:1")
    assert "H100" not in runtime_cache_key("model", "cpu")


# ---------------------------------------------------------------- host reads
# the budget: at most 2 host reads per middle-drafter step and 3 per verification (greedy), over every turn
READS_PER_MIDDLE_STEP, READS_PER_VERIFICATION = 2, 3


@pytest.mark.parametrize("draft_vocab", [None, 64])
@pytest.mark.parametrize("method", ["all_small", "all_mid", "fixed", "treegraft", "csd"])
def test_host_reads_per_turn_stay_within_budget(tiny_pair, method, draft_vocab):
    dec = decoder(tiny_pair, method, draft_vocab=draft_vocab)
    dec.generate(PROMPT, 8)  # the verification curve and the frequent tokens are measured / read once
    marks = []
    with count_host_reads() as reads:
        out = dec.generate(PROMPT, 64, before_turn=lambda turn, root: marks.append(reads.total))
    marks.append(reads.total)
    per_turn = [b - a for a, b in zip(marks, marks[1:])]
    assert len(per_turn) == len(out.turns) > 5
    prefill = marks[0]
    assert prefill <= 1, reads.by_site  # the prompt's top-m and log-probabilities, in one read
    for reads_in_turn, turn in zip(per_turn, out.turns):
        steps = turn["middle_calls"] if method != "csd" else turn["middle_calls"]
        assert reads_in_turn <= READS_PER_MIDDLE_STEP * steps + READS_PER_VERIFICATION, (turn, reads.by_site)


def test_host_read_counter_counts_every_kind_of_read():
    x = torch.arange(4, device="cpu")
    with count_host_reads() as reads:
        x.tolist(), x[0].item(), float(x[1]), int(x[2]), bool(x[3]), [0, 1][x[1]], x.cpu(), x.numpy()
        with reads.pause():
            x.tolist()
    assert reads.total == 8 and set(reads.by_method) == {"tolist", "item", "__float__", "__int__", "__bool__",
                                                          "__index__", "cpu", "numpy"}
    assert x.tolist() == [0, 1, 2, 3]  # the methods are restored


def test_sampling_reads_one_per_visited_row(tiny_pair):
    """Under sampling a visited row costs one read (its children's probabilities and their uniform draws),
    the bonus one more."""
    dec = decoder_for("fixed", TorchEngines(tiny_pair.target, tiny_pair.middle, tiny_pair.tokenizer), {},
                      SamplingConfig(temperature=0.8, seed=3))
    dec.generate(PROMPT, 8)
    marks = []
    with count_host_reads() as reads:
        out = dec.generate(PROMPT, 48, before_turn=lambda turn, root: marks.append(reads.total))
    marks.append(reads.total)
    for n, turn in zip([b - a for a, b in zip(marks, marks[1:])], out.turns):
        assert n <= READS_PER_MIDDLE_STEP * turn["middle_calls"] + turn["accepted"] + 3


# ---------------------------------------------------------------- workers on GPUs
def _note_gpus(context, pull, report):
    """A spawned worker: writes which GPUs it sees and the jobs it pulled."""
    import json
    import os

    jobs = list(pull)
    Path(context, f"worker-{os.environ['CUDA_VISIBLE_DEVICES']}.json").write_text(json.dumps(jobs))
    report(len(jobs))


def test_gpu_workers_get_gpus_of_their_own_or_are_refused_in_one_line(tmp_path):
    from treegraft.pipeline.parallel import WorkerSetupError, gpu_worker_groups, spawn_pull

    assert gpu_worker_groups(4, 2, visible=8) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_worker_groups(1, 1, visible=1) == ["0"]
    with pytest.MonkeyPatch.context() as mp:  # a SLURM job's GPUs keep their names
        mp.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        assert gpu_worker_groups(2, 2, visible=4) == ["4,5", "6,7"]
    with pytest.raises(WorkerSetupError, match=r"workers=2 on CUDA needs 2 GPU\(s\) \(1 per worker.*1 visible") as err:
        gpu_worker_groups(2, 1, visible=1)
    assert "\n" not in str(err.value)
    done = []
    spawn_pull(_note_gpus, [str(tmp_path)] * 2, ["0", "1"], list(range(7)), [1.0] * 7, done.append)
    import json

    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")}
    assert set(seen) == {"worker-0.json", "worker-1.json"}  # each its own CUDA_VISIBLE_DEVICES
    assert sorted(seen["worker-0.json"] + seen["worker-1.json"]) == list(range(7)) and sum(done) == 7


@pytest.mark.parametrize("stage", ["collect", "evaluate"])
def test_two_workers_on_one_gpu_are_refused_before_loading(stage, tmp_path, monkeypatch):
    from tests.conftest import compose
    import treegraft.models as models
    import treegraft.models.loading as loading
    from treegraft.pipeline.collect import run_collect
    from treegraft.pipeline.evaluate import run_evaluate
    from treegraft.pipeline.parallel import WorkerSetupError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for module in (models, loading):
        monkeypatch.setattr(module, "load_pair_from_settings", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    extra = ["evaluation.methods=[ar,all_small]"] if stage == "evaluate" else []
    cfg = compose(stage, [*extra, "experiment=smoke", "pipeline.device=cuda", "pipeline.workers=2",
                          f"paths.output_dir={tmp_path}"])
    with pytest.raises(WorkerSetupError, match="workers=2 on CUDA needs 2 GPU"):
        (run_collect if stage == "collect" else run_evaluate)(cfg)


# ---------------------------------------------------------------- grouped-query attention under a tree mask
def test_folded_gqa_attention_equals_repeated_kv():
    """tree_sdpa (query heads folded into their K/V head's rows) gives transformers' sdpa (K/V repeated per
    query head) under a tree mask, and hands every other case to it unchanged."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from treegraft.model_io import tree_sdpa

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, past = 5, 11
    query = torch.randn(1, q, 6, 8).transpose(1, 2)  # [B, H, q, d], a transposed view as the layers pass it
    key, value = torch.randn(1, 2, past + q, 8), torch.randn(1, 2, past + q, 8)
    allowed = torch.ones(q, past + q, dtype=torch.bool)
    allowed[:, past:] = torch.rand(q, q) < 0.5
    allowed[:, past:] |= torch.eye(q, dtype=torch.bool)
    mask = torch.zeros(q, past + q).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    got, _ = tree_sdpa(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (1, q, 6, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one_row, _ = tree_sdpa(module, query[:, :, :1], key, value, mask[:, :, :1], scaling=0.3)  # one row: stock path
    torch.testing.assert_close(one_row, sdpa_attention_forward(module, query[:, :, :1], key, value, mask[:, :, :1],
                                                               scaling=0.3)[0])


def test_tree_forwards_fold_gqa_and_plain_calls_keep_sdpa(tiny_pair, monkeypatch):
    """The tiny target has 4 query heads over 2 K/V heads: its tree forwards run tree_sdpa, its plain calls
    (ar) and anything outside a tree forward keep transformers' sdpa."""
    import treegraft.model_io as model_io

    calls = []
    real = model_io.tree_sdpa
    monkeypatch.setattr(model_io, "tree_sdpa", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(model_io.TREE_SDPA, None)  # re-registered with the counting wrapper
    dec = decoder(tiny_pair, "fixed")
    out = dec.generate(PROMPT, 16)
    assert calls and max(calls) > 1  # tree rows went through the folded attention
    assert tiny_pair.target.config._attn_implementation == "sdpa"
    assert out.tokens == ar_decoder(tiny_pair.target).generate(PROMPT, 16).tokens
    AttentionInterface._global_mapping.pop(model_io.TREE_SDPA, None)
