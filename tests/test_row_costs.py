"""scripts/row_costs.py and scripts/sizes_table.py (docs/benchmarks.md, "The sizes users
run"): every form's single-MatMul graph computes the product it stands for, row-exactness is
told apart, and the size table's arithmetic (our graph's layer shapes, the layers' MatMul
sum, the prediction) is what its docstrings say. No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from tests.script_util import load_script

rc = load_script("row_costs")
st = load_script("sizes_table")


@pytest.mark.parametrize("form", rc.FORMS)
def test_each_form_computes_the_product(form, tmp_path):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 48)) * 0.02).astype(np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    sess = rc.session(rc.BUILD[form](w), tmp_path, threads=1)
    y = sess.run(None, {"x": x})[0]
    assert y.shape == (5, 48)
    # 4-bit weights and 8-bit rows: within a few % of the fp32 product's scale
    np.testing.assert_allclose(y, x @ w, atol=0.08 * np.abs(x @ w).max())


def test_row_exactness_is_told_apart(tmp_path):
    """int8-rows quantizes each row by itself; DynamicQuantizeMatMul one scale for all rows,
    so rows scaled unlike the first change the first row's result."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 48)) * 0.02).astype(np.float32)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    x[1:] *= 3.0
    rows = (1, 2, 4)
    assert rc.row_exact(rc.session(rc.int8_rows(w), tmp_path, 1), x, rows)
    assert not rc.row_exact(rc.session(rc.dq_matmul(w), tmp_path, 1), x, rows)


def test_layer_shapes_are_our_graphs_matmuls():
    # Llama-3.2-1B: q 2048 + k, v 8 heads x 64; gate/up 2 x 8192; down 8192 -> 2048
    assert st.layer_shapes("llama3.2-1b") == ["2048x3072", "2048x2048", "2048x16384",
                                              "8192x2048"]
    # Qwen2.5-0.5B: 14 heads of 64, 2 KV heads
    assert st.layer_shapes("qwen2.5-0.5b") == ["896x1152", "896x896", "896x9728", "4864x896"]


def test_body_estimate_sums_a_layer_times_the_layers():
    shapes = st.layer_shapes("qwen2.5-0.5b")
    costs = {s: {"nbits4": {"us": {"1": 100.0 * (i + 1), "2": 150.0 * (i + 1)}}}
             for i, s in enumerate(shapes)}
    ms = st.body_estimate("qwen2.5-0.5b", costs)
    assert ms == {1: pytest.approx(24 * 1000 / 1000), 2: pytest.approx(24 * 1500 / 1000)}


def test_prediction_without_a_bench_json_is_tau_over_the_step():
    costs = {t: 10.0 * (1 + 0.2 * (t - 1)) for t in range(1, 10)}  # each row +20%
    p = st.predictions(None, costs)
    assert p["ngram k=1"] == pytest.approx(st.SMOLLM2_TAU["ngram"][1] / 1.2, abs=1e-3)
    assert p["mtp k=4"] == pytest.approx(
        st.SMOLLM2_TAU["mtp"][4] / (1.8 + 4 * st.DRAFT_PER_TOKEN["mtp"]), abs=1e-3)
