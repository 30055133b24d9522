"""The runtime context a learned scheduler reads (ms per target verification and per middle call), measured
by warm-up generations, and what the middle drafter's first call of a prompt will add (the call gate's
prior). A part of :class:`~treegraft.decoding.tree_decoder.TreeGraftDecoder`, kept apart for its length."""

from __future__ import annotations

import copy
import statistics
from typing import Sequence

from ..scheduling import FixedScheduler
from ..tree import MIDDLE
from .budget import BudgetPlanner

__all__ = ["RuntimeContext"]


class RuntimeContext:
    """Mixed into the tree decoder: reads its ``scheduler``, ``gate``, ``planner``, ``middle``, ``cfg`` and
    ``generate``; sets ``t_tgt_ms``, ``t_mid_ms`` and ``context_samples``."""

    def warm_up(self, prompt_ids: Sequence[int], max_new_tokens: int = 8, repeats: int = 1) -> tuple[float, float]:
        """Measure the scheduler's runtime context on ``repeats`` warm-up generations that call the middle
        drafter at every step (not scored): sets and returns (t_tgt_ms, t_mid_ms), the *medians* over
        every warm-up turn of the verification forward and of one middle call (a slow spell of a
        shared machine moves a mean, not a median); the per-turn samples stay in ``context_samples``.

        The middle drafter encodes the prompt at prefill here, as in `collect` (``eager_middle_prefill``),
        so ``t_mid`` is what a call costs, not a call plus the prompt's catch-up: with the lazy catch-up
        the first call of a short warm-up carries the whole prompt, which doubled ``t_mid`` on a
        200-token prompt and made a learned scheduler price every call as twice as dear as the turns it
        was fitted on.

        The budget planner is left as the warm-up found it: its running drafting time would otherwise
        start the scored decoding at an all-call turn's (5 middle calls, 1.9 s on a Zen 1 EPYC), and a
        turn's verified size is chosen for a sunk cost that large (``(1 + AL) / (draft + t(B + 1))``): a
        method that rarely calls verified 9-node trees for its first ~20 turns, 2.4x slower than `ar`."""
        saved, eager, gate = self.scheduler, self._eager_middle_prefill, self.gate
        planner = copy.deepcopy(self.planner)
        self.scheduler = FixedScheduler([MIDDLE] * self.cfg.depth) if self.middle is not None else saved
        self._eager_middle_prefill, self.gate = True, None
        turns = []
        try:
            for _ in range(max(1, int(repeats))):
                turns += self.generate(prompt_ids, max_new_tokens).turns
        finally:
            self.scheduler, self._eager_middle_prefill, self.gate = saved, eager, gate
            if planner is None and self.planner is not None:  # first made here: keep its measured curve only
                planner = BudgetPlanner(self.planner.curve, self.cfg.auto_max_budget)
            self.planner = planner
        tgt = [1000 * t["target_forward_s"] for t in turns]
        mid = [1000 * t["middle_forward_s"] / t["middle_calls"] for t in turns if t["middle_calls"]]
        self.context_samples = {"t_tgt_ms": tgt, "t_mid_ms": mid}
        self.t_tgt_ms = float(statistics.median(tgt)) if tgt else 0.0
        self.t_mid_ms = float(statistics.median(mid)) if mid else 0.0
        return self.t_tgt_ms, self.t_mid_ms

    def _catch_up_estimate_s(self, prompt_len: int) -> float:
        """What the middle drafter's first call of a prompt adds to a call: encoding the prompt's rows,
        priced at the target's per-row cost in its widest measured verification times ``t_mid / t_tgt``
        (the runtime context's ratio of the two models' costs); 0 without a measured context, or where
        the prompt is encoded at prefill."""
        if self.middle is None or self._eager_middle_prefill or not self.t_tgt_ms or not self.t_mid_ms:
            return 0.0
        curve = self._planner().curve
        widest = max(curve)
        return (prompt_len - 1) * curve[widest] / widest * self.t_mid_ms / self.t_tgt_ms
