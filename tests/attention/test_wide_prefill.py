"""DP attention's head counts in the prefill (issue 41): a table's ``prefill.wide`` rows.

Above 16 local heads (V4-Flash at TP1/TP2, V4-Pro at TP1/TP2/TP4: 64, 32, 128, 64, 32
heads) the plugin takes a layer kind's prefill only where a GPU run measured ours (the
wgmma kernel's wide head blocks) faster at exactly that head count, and runs it with the
tiles of that run.  The shipped H200 table has no such row (not measured).  CPU: the
row's parse and refusals, the decision per kind and head count, the step rule, and the
tiles reaching the kernels through the layer's binding (the result equal to the
reference); through vLLM's own prefill: ``test_vllm_prefill.py`` (``c4a-64-heads-wide``).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import Any

import pytest
import torch

import dsv4_kernels as dk
from dsv4_attention import policy, tables
from dsv4_attention.facts import LayerFacts
from dsv4_attention.policy import Device, Switches
from dsv4_attention.prefill import PrefillPlan, forward_prefill, reference_forward_prefill
from dsv4_kernels.sparse_mla import TILES
from dsv4_kernels.testing import fresh_seed
from dsv4_kernels.testing.sparse_mla import random_q

from ._prefill_scenario import Scenario, StepRequest
from .test_prefill_forward import layer_kwargs

HOPPER = Device("NVIDIA H200", (9, 0), wgmma=True)
WIDE_TILES = {**TILES["large"], "KERNEL": 2, "ASYNC_PV": 1}


def _shipped() -> dict[str, Any]:
    text = resources.files("dsv4_attention").joinpath("tables", "NVIDIA_H200.json").read_text()
    return json.loads(text)


def _table(wide: dict[str, Any]) -> tables.MeasuredTable:
    data = _shipped()
    data["prefill"]["wide"] = wide
    return tables.parse_table(data, "mine.json")


TABLE = _table(
    {
        "64": {"kinds": ["c4a", "c128a"], "tiles": {**WIDE_TILES, "WIDE_HT": 64}},
        "32": {"kinds": ["swa"], "tiles": {**WIDE_TILES, "WIDE_HT": 32}},
    }
)


def _facts(ratio: int, heads: int, family: str = "v4") -> LayerFacts:
    return LayerFacts(
        name=f"layers.{ratio}.attn",
        compress_ratio=ratio,
        heads=heads,
        window=128,
        topk=512,
        c128a_width=128,
        max_tokens=1024,
        decode_window_width=128,
        kv_cache_dtype="fp8_ds_mla",
        family=family,
    )


def test_the_shipped_h200_table_has_no_wide_row() -> None:
    assert tables.parse_table(_shipped()).prefill.wide == {}


@pytest.mark.parametrize(
    "row, match",
    [
        ({"16": {"kinds": ["swa"], "tiles": {"KERNEL": 2, "WIDE_HT": 32}}}, "above 16"),
        ({"64": {"kinds": ["c2a"], "tiles": {"KERNEL": 2, "WIDE_HT": 64}}}, r"kinds must be"),
        ({"64": {"kinds": ["swa"], "tiles": {"KERNEL": 2, "WIDE_HT": 48}}}, "wide blocks"),
        ({"64": {"kinds": ["swa"], "tiles": {"KERNEL": 0, "WIDE_HT": 64}}}, "wide blocks"),
        ({"64": {"kinds": ["swa"], "tiles": {"KERNEL": 2, "WIDE_HT": 64, "X": 1}}}, r"\['X'\]"),
        ({"64": {"kinds": ["swa"]}}, "tiles must be an object"),
        ([64], "prefill.wide must be an object"),
    ],
)
def test_a_bad_wide_row_is_named(row: Any, match: str) -> None:
    with pytest.raises(ValueError, match=r"mine\.json is malformed.*" + match):
        _table(row)


@pytest.mark.parametrize(
    "ratio, heads, ours",
    [(4, 64, True), (128, 64, True), (1, 64, False), (1, 32, True), (4, 32, False),
     (128, 128, False), (4, 48, False)],
)  # fmt: skip
def test_taken_at_exactly_the_measured_head_count_and_kinds(
    ratio: int, heads: int, ours: bool
) -> None:
    """A row is never borrowed for another head count (48 is not 64) or kind."""
    facts = _facts(ratio, heads)
    choice = policy.prefill_choice(facts, HOPPER, TABLE, Switches())
    assert choice.ours is ours, choice
    tiles = policy.prefill_tiles(facts, TABLE, Switches())
    if ours:
        block = 64 if heads == 64 else 32
        assert f"at {heads} heads in blocks of {block}" in choice.reason
        assert tiles == {"large": {**WIDE_TILES, "WIDE_HT": block}}
        # every step of the kind is ours (no short-row rule above the limits)
        assert policy.prefill_step_takes_ours(facts, TABLE.prefill, Switches(), None)
    else:
        assert "measured faster above" in choice.reason and tiles is None
        assert policy.prefill_choice(facts, HOPPER, TABLE, Switches()).ours is False


def test_the_limits_and_vllms_own_choices_keep_their_rules() -> None:
    """V4.1's kinds, DSV4_PREFILL_MAX_HEADS and no Gluon kernel keep the limits; up to 16
    heads the row changes nothing."""
    assert not policy.prefill_choice(_facts(4, 64, "v41"), HOPPER, TABLE, Switches()).ours
    capped = policy.prefill_choice(_facts(4, 64), HOPPER, TABLE, Switches(max_heads=16))
    assert (
        not capped.ours
        and policy.prefill_tiles(_facts(4, 64), TABLE, Switches(max_heads=16)) is None
    )
    no_gluon = Device("NVIDIA H200", (9, 0), wgmma=False)
    assert not policy.prefill_choice(_facts(4, 64), no_gluon, TABLE, Switches()).ours
    for ratio in (1, 4, 128):
        small = _facts(ratio, 8)
        assert policy.prefill_tiles(small, TABLE, Switches()) is None
        assert policy.prefill_choice(small, HOPPER, TABLE, Switches()) == policy.prefill_choice(
            small, HOPPER, dataclasses.replace(TABLE, prefill=_table({}).prefill), Switches()
        )


@pytest.mark.parametrize("layer", ["c4a", "c128a"])
def test_the_tiles_reach_the_kernels_through_the_binding(
    layer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forward_prefill(tiles=)``: the layer's binding holds the tiles and hands them to
    every ``sparse_mla_paged`` call; at 20 heads the result equals the reference."""
    seen: list[Any] = []
    real = dk.sparse_mla_paged

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("tiles"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dk, "sparse_mla_paged", spy)
    heads = 20
    steps = [[StepRequest("a", 300, 5), StepRequest("b", 0, 3)]]
    sc = Scenario(
        steps, heads=heads, topk=64, c128a_topk=8, seed=fresh_seed(), device=torch.device("cpu")
    )
    inputs = sc.prepare_step(0)
    plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    q = random_q(inputs.num_tokens, heads, generator=sc.g, device="cpu")
    kw = layer_kwargs(sc, layer, inputs)
    tiles = {"large": {**WIDE_TILES, "WIDE_HT": 32}}
    got = forward_prefill(q, plan, tiles=tiles, **kw)
    assert seen == [tiles]
    fresh = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    want = reference_forward_prefill(q, fresh, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
