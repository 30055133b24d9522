"""The closed-loop margin teacher: known-answer turns where the right schedule depends on what a call reveals."""

import numpy as np
import pandas as pd
import pytest

from treegraft.pipeline.distill import (DISTILLED, TEACHERS, choose_teacher, distill_predictor, make_teacher, name_students,
                                       student_name)
from treegraft.scheduling.closed_loop import ClosedLoopConfig, fit_closed_loop_teacher
from treegraft.scheduling.features import state_names
from treegraft.scheduling.offline import (best_fixed_by_middle_cost, best_fixed_schedule, evaluate_policies, follow_policy,
                                         state_rows, turn_throughputs)
from treegraft.scheduling.policy import CostAwareFixedScheduler, StepState
from treegraft.scheduling.value import MLPConfig

DEPTH = 2


def _probe_rows(turns: int = 200, seed: int = 0) -> pd.DataFrame:
    """Half the turns are easy (every call adds 2 accepted tokens), half hard (calls add nothing); a call
    costs a fifth of a verification. Only after a call at step 1 does the step-2 state tell them apart
    (``sig_node_count`` = +1 easy, -1 hard; 0 before any call). Per turn, share of the oracle:
    easy 11 = 1, 10 = 0.78, 00 = 0.47; hard 00 = 1, 10 = 0.83, 11 = 0.71. The best fixed schedule is 11
    (0.86 on average); probing (call at step 1, then call again only on easy turns) reaches 0.92."""
    rng = np.random.default_rng(seed)
    rows = []
    for q in range(turns):
        easy = bool(rng.integers(0, 2))
        for k in range(2 ** DEPTH):
            schedule = format(k, f"0{DEPTH}b")
            calls = schedule.count("1")
            for step in range(1, DEPTH + 1):
                prefix = schedule[: step - 1]
                signal = 0.0 if prefix in ("", "0") else (1.0 if easy else -1.0)
                row = {"report": f"p/b{q % 5}", "question_id": q, "turn": 0, "schedule": schedule, "prefix": prefix,
                       "step": step, "action": int(schedule[step - 1]), "accepted": 1 + (2.0 * calls if easy else 0.0),
                       "latency_s": 0.1 + 0.02 * calls, "latency_target_s": 0.1, "latency_middle_s": 0.02 * calls,
                       "t_tgt_ms": 100.0, "t_mid_ms": 20.0, "log_prompt_len": 3.0, "log_tgt_mid_ratio": np.log(5.0),
                       "step_frac": step / DEPTH, "calls_frac": prefix.count("1") / DEPTH, "sig_node_count": signal,
                       "easy": easy}
                row.update({f"hist_{s}": float(s < step and schedule[s - 1] == "1") for s in range(1, DEPTH + 1)})
                rows.append(row)
    return pd.DataFrame(rows)


def _schedules(rows: pd.DataFrame, signals, decide) -> pd.Series:
    tau = turn_throughputs(rows)
    chosen = follow_policy(state_rows(rows), tau.index, DEPTH, state_names(DEPTH, signals), decide)
    return pd.Series(chosen, index=tau.index)


def test_the_closed_loop_teacher_learns_to_probe_with_a_call_and_its_student_follows():
    rows = _probe_rows()
    signals = ["node_count"]
    teacher = fit_closed_loop_teacher(rows, DEPTH, signals, ClosedLoopConfig(min_samples_leaf=20))
    easy = rows.drop_duplicates("question_id").set_index("question_id")["easy"]
    want = easy.map({True: "11", False: "10"})
    got = _schedules(rows, signals, lambda x, t: (teacher.margins(x, np.full(len(x), t)) > 0).astype(int))
    assert (got.droplevel([0, 2]).sort_index() == want.sort_index()).all()
    student, margins, predicted = distill_predictor(rows, teacher, MLPConfig(hidden=(16, 8), epochs=400))
    assert np.mean((margins > 0) == (predicted > 0)) == 1.0
    table = evaluate_policies(rows, DEPTH, {"student": (signals, lambda x, t: (student.predict(x) > 0).astype(int))})
    share = (100 * table["mean_tau"] / table.set_index("policy").loc["oracle", "mean_tau"]).set_axis(table["policy"])
    assert share["student"] > share["best fixed [11]"] + 2  # mean throughput: ~95% of the oracle against ~92%


def test_relabelled_timings_teach_that_a_dearer_call_stops_paying():
    """Calls that add half a token: at the measured timings 11 earns 3 tokens in 0.14 s (21.4/s) against 00's
    2 in 0.1 s (20/s); relabelled with a middle forward three times dearer, 3 in 0.22 s (13.6/s): calls stop
    paying, which only the relabelled copies can teach."""
    rows = _probe_rows(turns=120)
    rows = rows.assign(accepted=1 + 0.5 * rows["schedule"].str.count("1"), sig_node_count=0.0)
    signals = ["t_tgt_ms", "t_mid_ms", "node_count"]
    names = state_names(DEPTH, signals)
    x = state_rows(rows).xs("", level="prefix")[names].to_numpy(np.float64)
    dear = x.copy()
    dear[:, names.index("t_mid_ms")] *= 3.0
    steps = np.ones(len(x))
    teacher = fit_closed_loop_teacher(rows, DEPTH, signals, ClosedLoopConfig(min_samples_leaf=20), [0.33, 1.0, 3.0])
    assert (teacher.margins(x, steps) > 0).all() and (teacher.margins(dear, steps) < 0).all()
    student, _, _ = distill_predictor(rows, teacher, MLPConfig(hidden=(16, 8), epochs=400), [0.33, 1.0, 3.0])
    assert (student.predict(x) > 0).all() and (student.predict(dear) < 0).all()
    flat = fit_closed_loop_teacher(rows, DEPTH, signals, ClosedLoopConfig(min_samples_leaf=20))
    assert np.allclose(flat.margins(dear, steps), flat.margins(x, steps))  # without copies it cannot know


def test_the_closed_loop_teacher_needs_every_schedule_of_a_turn_and_a_known_kind():
    rows = _probe_rows(turns=20)
    with pytest.raises(ValueError, match="all 4 schedules"):
        fit_closed_loop_teacher(rows[rows["schedule"] != "11"], DEPTH, ["node_count"], ClosedLoopConfig())
    with pytest.raises(ValueError, match="closed_loop or open_loop, got 'loopy'"):
        make_teacher("loopy", rows, None, ["node_count"], ClosedLoopConfig(), [])


def test_teacher_auto_deploys_the_student_with_the_higher_held_out_share_and_marks_the_other():
    # two held-out turns; the oracle sums to 20 tokens/s, the closed-loop student to 14 (70%), the open-loop one to 16 (80%)
    turns = pd.DataFrame({
        "policy": ["oracle", "oracle", student_name("closed_loop"), student_name("closed_loop"),
                   student_name("open_loop"), student_name("open_loop"), "best fixed"],
        "tau": [10.0, 10.0, 4.0, 10.0, 8.0, 8.0, 9.0],
    })
    kind, shares = choose_teacher(turns, TEACHERS)
    assert kind == "open_loop"
    assert shares == pytest.approx({"closed_loop": 70.0, "open_loop": 80.0})
    named = name_students(turns, TEACHERS, kind)["policy"].tolist()
    assert named.count(DISTILLED) == 2 and named.count("distilled, closed-loop teacher (not deployed)") == 2
    assert named[-1] == "best fixed" and named[:2] == ["oracle", "oracle"]
    # a tie goes to the first kind listed (the closed loop), and one kind is its own choice
    tie = turns.assign(tau=[10.0, 10.0, 8.0, 8.0, 8.0, 8.0, 9.0])
    assert choose_teacher(tie, TEACHERS)[0] == "closed_loop"
    assert choose_teacher(turns, ["closed_loop"]) == ("closed_loop", pytest.approx({"closed_loop": 70.0}))


def test_the_fixed_fallback_is_re_picked_at_the_decoding_pairs_middle_cost():
    """On the probe turns 11 is the best fixed schedule at the collected costs; with a middle forward 8x dearer
    (a self-draft pair) 00 is: the fallback reads the decoding pair's t_mid / t_tgt and picks accordingly."""
    rows = _probe_rows(turns=40)
    table = best_fixed_by_middle_cost(rows)
    assert table["1"] == best_fixed_schedule(rows) == "11" and table["8"] == "00"
    policy = CostAwareFixedScheduler(table, ref_mid_over_tgt=0.2, default="11")

    def state(step, t_mid):
        return StepState(step=step, depth=DEPTH, history=[], prompt_len=9, t_tgt_ms=100.0, t_mid_ms=t_mid)

    assert [policy.decide(state(k, 20.0)) for k in (1, 2)] == [1, 1]  # the fitted pair's ratio
    assert [policy.decide(state(k, 160.0)) for k in (1, 2)] == [0, 0]  # 8x dearer
    assert policy.policy_name == "fixed:00"
    assert [policy.decide(state(k, 20.0)) for k in (1, 2)] == [1, 1]  # one object, two pairs: each keeps its own
    # between grid points b rounds up (a call is where a transfer error costs): 2.2 is nearer 2 (11) but takes 3's 00
    assert table["2"] == "11" and table["3"] == "00"
    assert policy.schedule_for(100.0, 20.0 * 2.2) == "00" and policy.schedule_for(100.0, 20.0 * 1.9) == "11"
    assert policy.schedule_for(100.0, 20.0) == table["1"] and policy.schedule_for(100.0, 20.0 * 20) == table["8"]
    with pytest.raises(ValueError, match="positive reference ratio"):
        CostAwareFixedScheduler(table, 0.0, "11")
