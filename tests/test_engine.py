"""The engine protocols: the tree decoder reaches its target only through a TargetEngine.

A scripted engine with no model at all (the next token is always the current one + 1) decodes through
the same decoder; a recording wrapper around the PyTorch engine shows which calls a turn and a schedule
enumeration make (the greedy-equality tests cover the real engine's numerics)."""

from __future__ import annotations

import torch

from treegraft.decoding import TreeConfig, TreeGraftDecoder
from treegraft.engines.torch import TorchTarget
from treegraft.devices import Clock
from treegraft.pipeline.enumeration import enumerate_turn
from .conftest import ar_decoder, tree_decoder

VOCAB = 16


class ScriptedForward:
    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def logits(self, rows):
        out = torch.full((len(rows), VOCAB), -10.0, device="cpu")
        for i, r in enumerate(rows):  # the target's next token after a row is that row's token + 1
            out[i, (self.tokens[r] + 1) % VOCAB] = 10.0
        return out


class ScriptedEngine:
    """A TargetEngine whose 'model' counts upwards modulo VOCAB; its cache is the list of context tokens."""

    device = head_device = torch.device("cpu")
    clock = Clock()
    prefill_charge_s = 0.0

    def __init__(self):
        self.context: list[int] = []
        self.pending: list[int] = []
        self.calls: list[str] = []

    def context_window(self):
        return 10_000

    def prefill(self, prompt_ids, top_m, vocab):
        self.calls.append("prefill")
        self.context = list(prompt_ids[:-1])
        m = min(top_m, VOCAB)
        ids = torch.tensor([[(t + 1 + k) % VOCAB for k in range(m)] for t in self.context], dtype=torch.long)
        lps = torch.tensor([[-0.01] + [-6.0] * (m - 1)] * len(self.context)).reshape(len(self.context), m)
        return ids.reshape(len(self.context), m), lps

    def context_len(self):
        return len(self.context)

    def forward_tree(self, inputs):
        self.calls.append("forward_tree")
        assert inputs.positions[0] == len(self.context)  # the root sits at the context length
        self.pending = list(inputs.token_ids)
        return ScriptedForward(inputs.token_ids)

    def keep(self, context_len, rows):
        self.calls.append("keep")
        self.context = self.context[:context_len] + [self.pending[r] for r in rows]

    def rollback(self, context_len):
        self.calls.append("rollback")
        self.context = self.context[:context_len]

    def verify_curve(self, cache_dir, max_size):
        return {n: 0.01 * (1 + n / 64) for n in (1, 2, 4, 8, 16, 32, 64)}

    def release(self):
        self.calls.append("release")


def test_a_model_free_engine_decodes_through_the_seam():
    engine = ScriptedEngine()
    prompt = list(range(VOCAB)) * 2 + [0, 1, 2]  # the n-gram drafter can copy the count from the prompt
    for cfg in (TreeConfig(method="all_small", budget=8), TreeConfig(method="all_small")):  # fixed and auto B_ver
        engine.calls.clear()
        dec = TreeGraftDecoder(engine, None, None, cfg, eos_ids=set())
        out = dec.generate(prompt, 40)
        assert out.tokens == [(3 + i) % VOCAB for i in range(40)]
        assert max(t["accepted"] for t in out.turns) >= 4  # the tree did the work, not one token a turn
        turns = len(out.turns)
        # one forward a turn, never a rollback; the cache released at the end
        assert engine.calls == ["prefill"] + ["forward_tree", "keep"] * turns + ["release"]
        assert engine.context_len() == len(prompt) - 1 + sum(t["accepted"] + 1 for t in out.turns)


class Recording(TorchTarget):
    def __init__(self, model, frequent):
        super().__init__(model, frequent)
        self.calls: list[tuple[str, int]] = []

    def forward_tree(self, inputs):
        self.calls.append(("forward_tree", self.context_len()))
        return super().forward_tree(inputs)

    def keep(self, context_len, rows):
        self.calls.append(("keep", context_len))
        super().keep(context_len, rows)

    def rollback(self, context_len):
        self.calls.append(("rollback", context_len))
        super().rollback(context_len)


def test_the_torch_engine_under_a_turn_and_an_enumeration(tiny_pair):
    tok, target, middle = tiny_pair.tokenizer, tiny_pair.target, tiny_pair.middle
    ids = tok("abab abab abab ab").input_ids
    cfg = TreeConfig(method="fixed", budget=6)
    dec = tree_decoder(target, middle, tok, cfg, eos_ids=set(), eager_middle_prefill=True)
    dec.engine = engine = Recording(target, dec.engine._frequent)
    enumerated = []

    def before_turn(index, root):
        if index == 1:
            length = engine.context_len()
            start = len(engine.calls)
            enumerated.append(enumerate_turn(dec, root))
            calls = engine.calls[start:]
            assert calls and all(name in ("forward_tree", "rollback") for name, _ in calls)
            assert calls[0::2] == [("forward_tree", length)] * (len(calls) // 2)
            assert calls[1::2] == [("rollback", length)] * (len(calls) // 2)  # every tree dropped whole
            assert engine.context_len() == length  # the state as it was

    out = dec.generate(ids, 24, before_turn=before_turn)
    assert out.tokens == ar_decoder(target, set()).generate(ids, 24).tokens
    assert enumerated and len(enumerated[0].outcomes) == 2 ** cfg.depth
    keeps = [c for c in engine.calls if c[0] == "keep"]
    assert len(keeps) == len(out.turns)
