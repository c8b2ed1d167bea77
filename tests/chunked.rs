//! SPEC 7's invariant: the chunked driver's raw, page and published candidates are
//! bitwise the untiled reference's, for every budget, role, ratio and format class.

mod common;

use common::strategies::{build, shape};
use dsa_indexer::dump::RoleKind;
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::problem::{Params, Problem, Role};
use dsa_indexer::reference;
use proptest::prelude::*;

proptest! {
    #![proptest_config(common::config(96))]

    #[test]
    fn chunked_equals_untiled_reference(s in shape(), budget_pick in 0usize..4, budget_raw in 1usize..4000, consumer in any::<bool>()) {
        let d = build(&s);
        let (batch, published) = common::strategies::batch_and_candidates(&d);
        let p = d.problem(&batch, published.as_ref()).unwrap();
        let want = reference::run(&p);
        // Budgets from one row per tile (1 byte) up to unbounded.
        let budget = [1usize, budget_raw, budget_raw * 16, usize::MAX][budget_pick];
        let (got, plan) = run_cpu(&p, budget).unwrap();
        prop_assert_eq!(&got, &want, "budget {} ({} tiles)", budget, plan.tiles.len());
        if budget == 1 {
            // One row per tile (rows that see no key take no bytes and may share).
            for t in &plan.tiles {
                prop_assert!(t.rows.clone().filter(|&i| batch.rows()[i].n > 0).count() <= 1);
            }
        }
        // The consumer of a source, through the driver too.
        if consumer && s.role == RoleKind::Source {
            let published = want.published.clone().unwrap();
            let rows: Vec<usize> = (0..batch.num_rows()).filter(|&i| p.publishes(i)).collect();
            let cbatch = match s.tail {
                Some(t) => batch.tail(t).unwrap(),
                None => batch.clone(),
            };
            let sub = common::strategies::sub_rows(&d, &rows);
            let params = Params { topk: s.topk, page_cols: None, block_size: s.block_size, num_blocks: s.num_blocks };
            let cp = Problem::new(&cbatch, sub.inputs(), params, Role::Consumer(&published)).unwrap();
            let (got, _) = run_cpu(&cp, budget).unwrap();
            prop_assert_eq!(got, reference::run(&cp));
        }
    }

    /// Any thread count gives the same bits through the driver.
    #[test]
    fn chunked_thread_count_invariance(s in shape(), threads in 2usize..5, budget in 1usize..2000) {
        let d = build(&s);
        let (batch, published) = common::strategies::batch_and_candidates(&d);
        let p = d.problem(&batch, published.as_ref()).unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let many = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let a = one.install(|| run_cpu(&p, budget).unwrap().0);
        let b = many.install(|| run_cpu(&p, budget).unwrap().0);
        prop_assert_eq!(a, b);
    }
}

/// Larger problems, still quick: the fast engine's row groups and the worker split
/// meet ragged rows from several requests in one tile.
#[test]
fn wider_batches_at_many_budgets() {
    wide(300, 8);
}

/// The heavy sweep: `cargo test --release --test chunked -- --ignored`.
#[test]
#[ignore]
fn heavy_wide_batches_at_many_budgets() {
    wide(3000, 24);
}

fn wide(max_seq: usize, cases: u32) {
    let strat = common::strategies::shape_with(max_seq, vec![8, 32]);
    let mut runner = proptest::test_runner::TestRunner::new(common::config(cases));
    runner
        .run(&strat, |s| {
            let d = build(&s);
            let (batch, published) = common::strategies::batch_and_candidates(&d);
            let p = d.problem(&batch, published.as_ref()).unwrap();
            let want = reference::run(&p);
            for budget in [1usize, 777, 4096, 1 << 16, usize::MAX] {
                prop_assert_eq!(&run_cpu(&p, budget).unwrap().0, &want, "budget {}", budget);
            }
            Ok(())
        })
        .unwrap();
}
