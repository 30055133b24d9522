"""The n-gram headroom replay (treegraft.pipeline.headroom) on cases with known answers."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from treegraft.pipeline.headroom import NGramIndex, curve_cost, headroom, load_ar_records, load_bench_records, replay, replay_all, step_table

# the prompt ends in 0, and 0 was followed by 1 .. 9 earlier: the output 1 .. 9 is one long copy
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
COPY = [1, 2, 3, 4, 5, 6, 7, 8, 9]
NOVEL = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # never seen before: nothing to draft


def _records(outputs, wall=10.0, prefill=1.0):
    return pd.DataFrame([{"pair": "p", "benchmark": "b", "question_id": i, "prompt": PROMPT, "output": out,
                          "prefill_s": prefill, "wall_s": wall, "cpu": "x", "runtime": "r"}
                         for i, out in enumerate(outputs)])


def test_index_takes_the_longest_match_and_says_whether_its_continuation_is_unanimous():
    index = NGramIndex(max_n=3)
    for token in [1, 2, 3, 1, 2, 4, 1, 2]:
        index.append(token)
    token, order, unanimous = index.top([1, 2])
    assert (order, unanimous) == (2, False) and token == 4  # 3 and 4 each followed (1, 2) once: the most recent wins
    assert index.followers([1, 2], [2]) == {3, 4}
    assert index.top([9]) is None


def test_a_flat_curve_makes_a_whole_copy_one_step_and_a_linear_one_makes_drafting_free_of_gain():
    flat = [1.0] * 9
    linear = [k + 1.0 for k in range(9)]
    for policy in ("hindsight_any", "hindsight_chain"):
        assert replay(PROMPT, COPY, policy, flat, max_n=3, max_depth=8) == (1, 1.0, 8)  # 8 drafts + the bonus
        steps, cost, rows = replay(PROMPT, COPY, policy, linear, max_n=3, max_depth=8)
        assert cost == pytest.approx(len(COPY))  # t(a + 1) = a + 1 units for a + 1 tokens
        assert replay(PROMPT, NOVEL, policy, flat, max_n=3, max_depth=8) == (9, 9.0, 0)


def test_the_calibrated_chain_drafts_only_what_pays_at_the_curve():
    flat, steep = [1.0] * 9, [1.0 + 10 * k for k in range(9)]
    sure = {(order, depth, unanimous): 1.0 for order in range(1, 4) for depth in range(3) for unanimous in (True, False)}
    assert replay(PROMPT, COPY, "calibrated_chain", flat, 3, 8, sure) == (1, 1.0, 8)
    assert replay(PROMPT, COPY, "calibrated_chain", steep, 3, 8, sure) == (9, 9.0, 0)  # a row costs 10 steps: never draft
    never = {kind: 0.0 for kind in sure}
    assert replay(PROMPT, COPY, "calibrated_chain", flat, 3, 8, never) == (9, 9.0, 0)


def test_headroom_speedups_are_tokens_per_cost_unit_and_keep_the_prefill():
    """Two copy prompts, a flat curve: decode 9x faster; end to end (9 + 1) / (9 / 9 + 1) = 5x."""
    table = headroom(_records([COPY, COPY], wall=10.0, prefill=1.0), {1: 0.05, 8: 0.05, 16: 0.05}, max_n=3,
                     max_depth=8, n_resamples=50)
    row = table[(table["policy"] == "hindsight_any") & (table["benchmark"] == "all")].iloc[0]
    assert row["decode x ar"].startswith("9.00") and row["end to end x ar"].startswith("5.00") and row["n"] == 2
    assert row["prefill share of ar"] == "0.10"


def test_curve_interpolates_between_measured_sizes_and_extrapolates_past_the_last():
    curve = {1: 10.0, 2: 12.0, 4: 20.0}
    assert curve_cost(curve, 3) == pytest.approx(16.0)
    assert curve_cost(curve, 6) == pytest.approx(28.0)


def test_records_without_prompt_ids_fail_with_the_file_named(tmp_path):
    path = tmp_path / "evaluate" / "p" / "b"
    path.mkdir(parents=True)
    (path / "ar.jsonl").write_text(json.dumps({"pair": "p", "benchmark": "b", "question_id": 1, "tokens": [1]}) + "\n")
    with pytest.raises(SystemExit, match="ar.jsonl has no prompt_ids"):
        load_ar_records(tmp_path, None)


def test_a_measured_decoder_is_placed_against_the_bound_and_bench_folders_are_read(tmp_path):
    """Copy prompts on a flat curve: the bound is 5x end to end; a decoder that took 4 s of decoding where ar
    took 9 (prefill 1 s each) is (9 + 1) / (4 + 1) = 2x, a quarter of the bound's gain (1 / 4)."""
    runs = tmp_path / "pair_x" / "runs"
    runs.mkdir(parents=True)
    for i in range(2):
        ar = {"tokens": COPY, "prefill_time_s": 1.0, "wall_time_s": 10.0}
        fast = {"tokens": COPY, "prefill_time_s": 1.0, "wall_time_s": 5.0}
        (runs / f"prompt_{i:03d}.json").write_text(json.dumps(
            {"key": {"cpu": "x"}, "benchmark": "b", "question_id": i, "prompt_ids": PROMPT,
             "results": {"llama:ar": ar, "llama:all_small": fast}}))
    records = load_ar_records(tmp_path / "pair_x", None)  # a bench folder: its runs/
    assert list(records["pair"]) == ["pair_x"] * 2 and records["output"][0] == COPY
    table = headroom(records, {1: 0.05, 8: 0.05, 16: 0.05}, max_n=3, max_depth=8, n_resamples=50,
                     decoders={"llama:all_small": load_bench_records(tmp_path / "pair_x", "llama:all_small")})
    row = table[(table["policy"] == "llama:all_small") & (table["benchmark"] == "all")].iloc[0]
    assert row["end to end x ar"].startswith("2.00") and row["of the bound's gain"].startswith("25%")
    bound = table[(table["policy"] == "hindsight_any") & (table["benchmark"] == "all")].iloc[0]
    assert bound["of the bound's gain"].startswith("100%")
    with pytest.raises(SystemExit, match="no prompt_ids or no llama:treegraft record"):
        load_bench_records(tmp_path / "pair_x", "llama:treegraft")


def test_the_cross_fitted_chain_sizes_each_prompt_with_the_other_half_of_the_prompts_rates():
    """A copy prompt and a novel one, each the other's fold: in sample the copy's first chain kind is accepted
    half the time, so on a flat curve the calibrated chain drafts the whole copy (1 step + 9 for the novel
    prompt: 18 / 10 = 1.8x); cross-fitted, the copy is sized by the novel prompt's rates (never accepted) and
    drafts nothing (9 + 9 steps: 1.0x)."""
    table = headroom(_records([COPY, NOVEL]), {1: 0.05, 8: 0.05, 16: 0.05}, max_n=3, max_depth=8, n_resamples=50)
    rows = table[table["benchmark"] == "all"].set_index("policy")["decode x ar"]
    assert rows["calibrated_chain"].startswith("1.80") and rows["calibrated_chain_crossfit"].startswith("1.00")
    same = headroom(_records([COPY, COPY]), {1: 0.05, 8: 0.05, 16: 0.05}, max_n=3, max_depth=8, n_resamples=50)
    same = same[same["benchmark"] == "all"].set_index("policy")["decode x ar"]
    assert same["calibrated_chain_crossfit"] == same["calibrated_chain"]  # both halves alike: the same rates


def test_step_table_splits_a_decoders_steps_into_verification_and_the_rest():
    """ar: 9 tokens in 9 s of decoding (1000 ms a token); the hindsight replay copies the 9 in one step at a flat
    curve (1 unit: 1000 ms); a decoder that took 3 turns of 2 accepted + the bonus, verifying 4 rows at 0.5 s each,
    in 2.4 s of decoding, spent 0.3 s a turn outside the target's forward."""
    records = _records([COPY], wall=10.0, prefill=1.0)
    turns = [{"accepted": 2, "verified_nodes": 4, "target_forward_s": 0.5}] * 3
    decoder = records.assign(wall_s=3.4, turns=[turns])
    replays = replay_all(records, {1: 0.05, 16: 0.05}, max_n=3, max_depth=8)
    table = step_table(records, replays, decoders={"lib": decoder}).set_index("policy")
    assert table.loc["ar (measured)", "ms / step"] == 1000.0
    assert table.loc["hindsight_any", ["tokens / step", "rows / step", "ms / step"]].tolist() == [9.0, 8.0, 1000.0]
    lib = table.loc["lib"]
    assert (lib["tokens / step"], lib["rows / step"]) == (3.0, 4.0)
    assert lib["ms / step"] == pytest.approx(800.0) and lib["other ms / step"] == pytest.approx(300.0)
