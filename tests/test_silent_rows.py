"""The helpers of issue 33's end-to-end checks (tests/silent_rows.py) on one process: the fast row reference
equals `symmring.moe.reference.reference_moe`, `wrong_rows` counts what it should, and `tally` turns step
records into the soak's counts (a silent wrong row, a fault raised everywhere or not, a late host absorbed)."""

from __future__ import annotations

import numpy as np
import pytest

import silent_rows
from silent_rows import StepRecord, tally
from symmring.moe.reference import reference_moe


@pytest.mark.parametrize("x_format", ["fp8_e4m3", "bf16"])
def test_fast_reference_equals_the_reference_moe(x_format):
    defs = silent_rows.make_layer_defs(3, ((128, 32, 2), (256, 64, 3)), 12, bf16=x_format == "bf16")
    for li, d in enumerate(defs):
        x, idx, w = silent_rows.step_inputs(3, 0, li, 0, 17, d, x_format == "bf16")
        idx[0, 0] = -1  # a masked entry
        ref = reference_moe(x, w_gate=d.w_gate, w_up=d.w_up, w_down=d.w_down, num_topk=d.topk, topk_idx=idx,
                            topk_weights=w, x_format=x_format).y
        fast = silent_rows.reference_rows(d, x, idx, w, x_format)
        np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-6 * float(np.abs(ref).max()))
        assert silent_rows.wrong_rows(ref, fast, 1e-4) == 0
    assert silent_rows.reference_rows(defs[0], x[:0], idx[:0], w[:0], x_format).shape == (0, defs[0].hidden)


def test_wrong_rows_counts_wrong_and_nan_rows():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 8))
    y = ref.copy()
    y[1] *= 1.5  # wrong by 50 %
    y[4] = np.nan  # poisoned
    assert silent_rows.wrong_rows(y, ref, 0.05) == 2
    assert silent_rows.wrong_rows(y, ref, 0.05, finite_only=True) == 1
    assert silent_rows.wrong_rows(ref[:5], ref, 0.05) == 6  # a shape that is not the reference's: every row


def test_tally_counts_faults_and_silent_rows():
    def records(rank_faulty):
        recs = [StepRecord(s, None) for s in range(8)]
        recs[1] = StepRecord(1, "refused", 0, body_raised=rank_faulty == 0)
        recs[2].entry_raised = True
        recs[3].after_reset = True
        recs[5] = StepRecord(5, "late_host", 1)
        recs[6] = StepRecord(6, None, wrong=2, finite_wrong=2)  # wrong rows, no error: silent
        return recs
    t = tally([records(0), records(1)], [10, 10])
    assert t.steps == 8 and t.faults == {"refused": 1, "stall": 0, "late_host": 1}
    assert t.raised_everywhere["refused"] == 1 and t.late_absorbed == 1 and (t.resets, t.right_after_reset) == (1, 1)
    assert t.silent_wrong_rows == 4 and t.finite_wrong_rows == 4 and t.rows_checked == 20
    assert any("no error" in p for p in t.problems)
    both = [records(0), records(1)]
    both[1][2].entry_raised = False  # rank 1 never raised for the refused call: not raised everywhere
    assert tally(both, [0, 0]).raised_everywhere["refused"] == 0
