"""The layer-level prefill benchmark's cases (``benchmarks/cases_prefill_layer.py``) check
what they time: each provider's output against the reference forward, and a provider
that leaves its output unwritten or computes it from other inputs fails that check.
(``python3 -m nox -s bench`` runs and times the whole smoke matrix.)"""

from __future__ import annotations

import pytest
import torch
from benchmarks import cases_prefill_layer as cpl
from benchmarks.harness import FLOOR, run_cases
from benchmarks.inputs_sparse_mla import make_inputs

from dsv4_kernels.testing import fresh_seed

CPU = torch.device("cpu")


def test_matrix_covers_both_models_and_every_layer_type() -> None:
    kinds = {(s.layer, s.heads) for s in cpl.MATRIX}
    assert kinds == {(layer, h) for layer in ("swa", "c4a", "c128a") for h in (8, 16)}
    assert {(s.layer, s.heads) for s in cpl.SMOKE} <= kinds
    assert {s.layer for s in cpl.SMOKE} == {"swa", "c4a", "c128a"}
    assert {s.query_len * s.num_reqs for s in cpl.MATRIX} == {1024, 4096, 16384}


def test_every_provider_is_checked_then_timed() -> None:
    case = cpl.layer_case(make_inputs(cpl.SMOKE[0], CPU, fresh_seed()), flashmla=False)
    results = run_cases([case], CPU, bandwidth=1e10, rep_ms=1, log=lambda _: None)
    assert [r.provider for r in results] == [cpl.OURS, cpl.OURS_PLAN, FLOOR]  # no FlashMLA here
    assert results[0].params["keys_total"] > 0 and results[0].floor_bytes > 0


@pytest.mark.parametrize("fault", ["unwritten", "other-inputs"])
def test_a_wrong_output_fails_the_check(fault: str) -> None:
    inp = make_inputs(cpl.SMOKE[0], CPU, fresh_seed())
    case = cpl.layer_case(inp, flashmla=False)
    if fault == "other-inputs":
        inp.q.neg_()  # after the reference: the providers now compute another layer's output
    for prov in case.providers:
        prov.poison()
        if fault != "unwritten":
            prov.run()
        with pytest.raises(AssertionError):
            prov.check()
