"""tools/fidelity.py's coarse KL: the figure given to runtimes that return only a top-N."""

import numpy as np
from trt_spec.tools.fidelity import coarse_kl, log_softmax


def test_coarse_kl_is_a_lower_bound_and_exact_without_a_rest():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lp_ref = log_softmax(rng.standard_normal(50) * 3)
        lp_test = log_softmax(rng.standard_normal(50) * 3)
        full = float((np.exp(lp_ref) * (lp_ref - lp_test)).sum())
        top = np.argsort(-lp_test)[:10]
        assert 0 <= coarse_kl(lp_ref, top, lp_test[top]) <= full + 1e-12
        everything = np.arange(50)
        assert np.isclose(coarse_kl(lp_ref, everything, lp_test[everything]), full)


def test_coarse_kl_of_a_distribution_to_itself_is_zero():
    lp = log_softmax(np.linspace(-3, 3, 30))
    top = np.argsort(-lp)[:5]
    assert abs(coarse_kl(lp, top, lp[top])) < 1e-12
