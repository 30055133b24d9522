"""The report's two studies from records alone: Table 9 (the small drafter's choice) and the grafting traces
(Appendix G), their files and the index; the evaluation's coverage in the report."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from treegraft.pipeline.estimates import PromptTable
from treegraft.pipeline.records import summarize_records
from treegraft.pipeline.report import make_tables, small_drafter_table

from .test_report import BENCHES, _records


def test_table_9_puts_each_neural_small_drafter_beside_the_ngram_one_with_the_ngram_gain():
    rec = _records({"p": {"fixed": 1.2, "fixed@self_draft": 0.8}}, seed=3)
    rec.loc[rec["method"] == "fixed@self_draft", "t_small_s"] = 0.4  # neural small steps cost time
    table = small_drafter_table(summarize_records(rec), prompts=PromptTable(rec, 400)).set_index("small drafter")
    assert list(table.index) == ["ngram", "self_draft"] and set(table["method"]) == {"fixed"}
    assert table.loc["ngram", "speedup"] == pytest.approx(1.2, rel=0.05)
    assert table.loc["self_draft", "speedup"] == pytest.approx(0.8, rel=0.05)
    gain = table.loc["self_draft"]
    expected = 100 * (table.loc["ngram", "speedup"] / table.loc["self_draft", "speedup"] - 1)
    assert gain["n-gram gain over it %"] == pytest.approx(expected, rel=0.05)  # ~ +50 %
    assert gain["n-gram gain over it % lo"] < gain["n-gram gain over it %"] < gain["n-gram gain over it % hi"]
    assert table.loc["ngram", "n-gram gain over it %"] != table.loc["ngram", "n-gram gain over it %"]  # NaN: itself
    assert table.loc["self_draft", "small time share"] > table.loc["ngram", "small time share"]
    assert (table["n prompts"] == len(BENCHES)).all()
    # no variant evaluated: no rows (the report then writes no file and the index names cpu_small)
    plain = _records({"p": {"fixed": 1.2}})
    assert small_drafter_table(summarize_records(plain), prompts=PromptTable(plain, 50)).empty


def _write_records(folder, rec: pd.DataFrame, grafting: dict | None = None) -> None:
    """``rec`` (read_records' frame) as record files that read_records reads back."""
    for (pair, bench, method), g in rec.groupby(["pair", "benchmark", "method"]):
        path = folder / "evaluate" / pair / bench / f"{method}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for _, r in g.iterrows():
            record = {"pair": pair, "benchmark": bench, "method": method, "question_id": int(r["question_id"]),
                      "choices": [{"new_tokens": [int(r["new_tokens"])], "wall_time": [float(r["wall_time"])]}],
                      "turns": int(r["turns"]), "accepted": [2] * int(r["turns"]), "middle_calls": int(r["middle_calls"]),
                      "steps": int(r["steps"]),
                      "time_split": {k: float(r[f"t_{k}"]) for k in ("small_s", "middle_s", "verify_s", "other_s")},
                      "matches_ar": r["matches_ar"], "runtime": "float32", "tree_shape": "auto", "cpu": "cpu",
                      "tstamp": 1.0}
            if method != "ar" and grafting is not None:
                record["grafting"] = grafting
                record["grafting_examples"] = []
            lines.append(json.dumps(record))
        path.write_text("\n".join(lines) + "\n")


def test_the_report_writes_both_studies_and_says_which_prompts_have_no_record(tmp_path):
    from omegaconf import OmegaConf

    from .conftest import compose

    exp = tmp_path / "pipeline" / "study"
    rec = _records({"p": {"fixed": 1.2, "fixed@self_draft": 0.8, "no_nondestructive": 1.1}})
    _write_records(exp, rec, {"accepted_tokens": 10, "accepted_on_kept": 2, "turns": 5, "grafting_turns": 3,
                              "kept_turns": 1})
    cfg = compose("evaluate", ["experiment=cpu_small", f"paths.output_dir={tmp_path}", "pipeline.name=study",
                               "pipeline.pairs=[p]", "evaluation.benchmarks=[gsm8k]", "evaluation.prompts_per_benchmark=2"])
    (exp / "evaluate" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    out = tmp_path / "report"
    tables = make_tables(exp, out_dir=out, n_resamples=100)
    assert {"small_drafter", "grafting"} <= set(tables)
    share = tables["grafting"].set_index("method")["accepted on kept share"]
    assert share.loc["fixed"] == pytest.approx(0.2)
    index = (out / "README.md").read_text()
    assert "[small_drafter](small_drafter.md)" in index and "[grafting](grafting.md)" in index
    # the evaluation asked for 2 gsm8k prompts of 4 methods of pair p; the records hold benchmarks x and y only
    coverage = (out / "coverage.txt").read_text()
    assert "evaluate: 0 of 8 prompts present" in coverage and "p/gsm8k/fixed@self_draft" in coverage
    assert "## Coverage" in index and "evaluate: 0 of 8 prompts present" in index
    assert np.isfinite(tables["small_drafter"]["speedup"]).all()
