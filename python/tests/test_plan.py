"""``plan``: the CPU backend's row tiles and peak transient, as the crate plans them."""

import pytest

import dsa_indexer as di
from conftest import golden


def test_the_tiles_cover_every_row_once_under_the_budget():
    _, _, args = golden("source_tail.safetensors")
    out = di.reference(**args)
    rows = out.raw.shape[0]
    budget = 256
    p = di.plan(**args, budget=budget)
    tiles = p["tiles"]
    assert len(tiles) > 1
    assert tiles[0]["rows"][0] == 0 and tiles[-1]["rows"][1] == rows
    for a, b in zip(tiles, tiles[1:]):
        assert a["rows"][1] == b["rows"][0]
        assert a["published"][1] == b["published"][0]
    assert tiles[-1]["published"][1] == p["published_rows"] == len(out.published_rows)
    for t in tiles:
        assert t["logits_bytes"] <= budget or (t["oversized"] and t["rows"][1] - t["rows"][0] == 1)
    peak = p["peak"]
    terms = ("logits_tile", "block_scores", "candidate_ids", "topk_scratch", "index_assembly", "operands")
    assert peak["total"] == sum(peak[k] for k in terms)
    assert peak["logits_tile"] == max(t["logits_bytes"] for t in tiles)
    assert p["max_tile_rows"] == max(t["rows"][1] - t["rows"][0] for t in tiles)
    assert p["unbounded_bytes"] > 0 and p["budget"] == budget and p["backend"] == "cpu"


def test_one_tile_under_the_default_budget():
    _, _, args = golden("v32_plain.safetensors")
    p = di.plan(**args)
    assert len(p["tiles"]) == 1 and not p["oversized_row"]


def test_a_budget_of_zero_is_named():
    _, _, args = golden("v32_plain.safetensors")
    with pytest.raises(ValueError, match="budget = 0: budget > 0 bytes"):
        di.plan(**args, budget=0)
    with pytest.raises(ValueError, match="budget = -5"):
        di.reference(**args, budget=-5)
