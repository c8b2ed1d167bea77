//! The planner: every row once, in order; tiles fit the budget unless a single row
//! exceeds it; the peak is the sum of its terms.

mod common;

use approx::assert_relative_eq;
use dsa_indexer::batch::Batch;
use dsa_indexer::indexer::RowFootprint;
use dsa_indexer::plan::{
    plan, unbounded_bytes, Footprint, PlanParams, PlanRole, DEFAULT_BUDGET, PIPELINE_TILES,
};
use proptest::prelude::*;

fn params(budget: usize, role: PlanRole) -> PlanParams {
    PlanParams {
        heads: 32,
        dim: 128,
        topk: 512,
        block_size: 8,
        num_blocks: 2048,
        role,
        budget,
    }
}

fn role() -> impl Strategy<Value = PlanRole> {
    prop_oneof![
        Just(PlanRole::Plain),
        Just(PlanRole::Consumer),
        prop::option::of(1usize..50).prop_map(|tail| PlanRole::Source { tail }),
    ]
}

proptest! {
    #![proptest_config(common::config(256))]

    #[test]
    fn tiles_cover_rows_in_order_and_fit(
        reqs in common::strategies::requests(3000),
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        budget in 1usize..200_000,
        align in prop::sample::select(vec![1usize, 4, 64, 128]),
        workers in 1usize..9,
        role in role(),
    ) {
        let seq: Vec<usize> = reqs.iter().map(|r| r.0).collect();
        let q0: Vec<usize> = reqs.iter().map(|r| r.1).collect();
        let batch = Batch::contiguous(&seq, &q0, ratio).unwrap();
        let fp = RowFootprint { align, workers, worker_bytes: 1000, logits_slots: 1 };
        let pl = plan(&batch, &params(budget, role), &fp).unwrap();
        // Coverage, in order.
        let mut next = 0;
        let mut next_pub = 0;
        for t in &pl.tiles {
            prop_assert_eq!(t.rows.start, next);
            prop_assert!(t.rows.end > t.rows.start);
            prop_assert_eq!(t.published.start, next_pub);
            next = t.rows.end;
            next_pub = t.published.end;
            let bytes: usize = t.rows.clone().map(|i| fp.row_bytes(batch.rows()[i].n)).sum();
            prop_assert_eq!(t.logits_bytes, bytes);
            if t.oversized {
                prop_assert_eq!(t.rows.len(), 1, "an oversized tile is one row");
                prop_assert!(bytes > budget);
            } else {
                prop_assert!(bytes <= budget);
            }
        }
        prop_assert_eq!(next, batch.num_rows());
        prop_assert_eq!(next_pub, pl.published_rows);
        // Greedy: a tile could not have taken the next row.
        for w in pl.tiles.windows(2) {
            let extra = fp.row_bytes(batch.rows()[w[1].rows.start].n);
            prop_assert!(w[0].logits_bytes + extra > budget);
        }
        // Peak terms.
        let pk = pl.peak;
        prop_assert_eq!(pk.logits_tile, pl.tiles.iter().map(|t| t.logits_bytes).max().unwrap_or(0));
        prop_assert_eq!(pk.total(), pk.logits_tile + pk.block_scores + pk.candidate_ids + pk.topk_scratch + pk.index_assembly + pk.operands);
        let source = matches!(role, PlanRole::Source { .. });
        prop_assert_eq!(pk.candidate_ids > 0, source && !pl.tiles.is_empty());
        prop_assert_eq!(pk.block_scores == 0, !source || pl.tiles.iter().all(|t| t.block_score_bytes == 0));
        prop_assert!(pk.block_scores <= pk.logits_tile / 8 + pl.max_tile_rows * 4 + 4, "block scores are capped by the tile");
        prop_assert!(pl.workers <= workers.max(1));
        prop_assert_eq!(pl.logits_slots, 1);
    }

    /// A backend that asks for two logits slots gets the one-slot tiles of at most half
    /// the budget and a PIPELINE_TILES-th of the batch's logits plus its widest row (so at
    /// most PIPELINE_TILES tiles where half the budget does not bind) when they are at
    /// least two and none is over half the budget (both slots then fit the budget), else
    /// the one-slot plan of the whole budget.
    #[test]
    fn two_slots_are_two_half_budget_tiles_or_one_slot(
        reqs in common::strategies::requests(3000),
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        budget in 1usize..200_000,
        align in prop::sample::select(vec![1usize, 4, 64]),
        role in role(),
    ) {
        let seq: Vec<usize> = reqs.iter().map(|r| r.0).collect();
        let q0: Vec<usize> = reqs.iter().map(|r| r.1).collect();
        let batch = Batch::contiguous(&seq, &q0, ratio).unwrap();
        let one = RowFootprint { align, workers: 3, worker_bytes: 1000, logits_slots: 1 };
        let two = RowFootprint { logits_slots: 2, ..one };
        let pl = plan(&batch, &params(budget, role), &two).unwrap();
        let whole = plan(&batch, &params(budget, role), &one).unwrap();
        let total: usize = batch.rows().iter().map(|r| one.row_bytes(r.n)).sum();
        let widest = batch.rows().iter().map(|r| one.row_bytes(r.n)).max().unwrap_or(0);
        let pipeline_cap = total.div_ceil(PIPELINE_TILES) + widest;
        let cap = (budget / 2).min(pipeline_cap).max(1);
        let split = plan(&batch, &params(cap, role), &one).unwrap();
        // Half the budget aside, the plan has no straggler tile past PIPELINE_TILES.
        if pipeline_cap <= budget / 2 {
            prop_assert!(pl.tiles.len() <= PIPELINE_TILES, "{} tiles", pl.tiles.len());
        }
        let max_tile = pl.tiles.iter().map(|t| t.logits_bytes).max().unwrap_or(0);
        prop_assert_eq!(pl.peak.logits_tile, pl.logits_slots * max_tile);
        if split.tiles.len() >= 2 && split.tiles.iter().all(|t| t.logits_bytes <= budget / 2) {
            prop_assert_eq!(pl.logits_slots, 2);
            let rows = |p: &dsa_indexer::plan::Plan| -> Vec<_> {
                p.tiles.iter().map(|t| (t.rows.clone(), t.published.clone(), t.logits_bytes, t.block_score_bytes)).collect()
            };
            prop_assert_eq!(rows(&pl), rows(&split));
            prop_assert!(pl.tiles.iter().all(|t| !t.oversized));
            prop_assert!(pl.peak.logits_tile <= budget);
            prop_assert_eq!(pl.published_rows, whole.published_rows);
            prop_assert_eq!(pl.peak.total() - pl.peak.logits_tile, split.peak.total() - split.peak.logits_tile);
        } else {
            prop_assert_eq!(pl.logits_slots, 1);
            prop_assert_eq!(&pl, &whole);
        }
    }
}

#[test]
fn budget_zero_and_bad_parameters_are_errors() {
    let batch = Batch::contiguous(&[10], &[0], 1).unwrap();
    let fp = RowFootprint {
        align: 4,
        workers: 1,
        worker_bytes: 0,
        logits_slots: 1,
    };
    let e = plan(&batch, &params(0, PlanRole::Plain), &fp).unwrap_err();
    assert_eq!(e.to_string(), "budget = 0: budget > 0 bytes");
    let e = plan(&batch, &params(10, PlanRole::Source { tail: Some(0) }), &fp).unwrap_err();
    assert!(e.to_string().starts_with("tail = 0"));
}

#[test]
fn single_rows_over_budget_are_tiles_of_their_own() {
    let batch = Batch::contiguous(&[100], &[90], 1).unwrap();
    let fp = RowFootprint {
        align: 4,
        workers: 2,
        worker_bytes: 0,
        logits_slots: 1,
    };
    let pl = plan(&batch, &params(100, PlanRole::Plain), &fp).unwrap();
    assert_eq!(pl.tiles.len(), 10);
    assert!(pl.has_oversized_row() && pl.tiles.iter().all(|t| t.oversized));
    assert_eq!(pl.peak.logits_tile, 100 * 4);
}

#[test]
fn seed_engine_figures() {
    // 16384-row chunks: 6 bytes per (row, key). README's 44.7 GiB is stated to three
    // figures (44.672 GiB); 96 GiB at 1M keys is exact.
    let gib = |b: u128| b as f64 / (1u128 << 30) as f64;
    let b = Batch::contiguous(&[487_936], &[487_936 - 16_384], 1).unwrap();
    assert_relative_eq!(gib(unbounded_bytes(&b)), 44.7, max_relative = 1e-3);
    let b = Batch::contiguous(&[1 << 20], &[(1 << 20) - 16_384], 1).unwrap();
    assert_eq!(gib(unbounded_bytes(&b)), 96.0);
    // At 1M keys under the default 2 GiB budget the CPU's planned peak stays under 2.5 GiB.
    let fp = RowFootprint {
        align: 4,
        workers: 64,
        worker_bytes: 1 << 20,
        logits_slots: 1,
    };
    for role in [
        PlanRole::Plain,
        PlanRole::Source { tail: Some(128) },
        PlanRole::Source { tail: None },
    ] {
        let pl = plan(&b, &params(DEFAULT_BUDGET, role), &fp).unwrap();
        assert!(pl.peak.total() <= 5 << 29, "{role:?}: {}", pl.peak.total());
        assert!(pl.peak.logits_tile <= DEFAULT_BUDGET);
    }
}
