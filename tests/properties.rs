//! Property tests of the reference (SPEC 3 to 6) over random ragged batches, prefix hits
//! and explicit-row layouts.

mod common;

use common::strategies::{build, case, shape, sub_rows, Shape};
use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, RoleKind};
use dsa_indexer::problem::{Params, Problem, Role};
use dsa_indexer::reference::{self, candidates, rank_key, topk};
use proptest::prelude::*;

fn logits_by_row(p: &Problem) -> Vec<Vec<f32>> {
    let flat = reference::logits(p);
    let mut off = 0;
    p.batch
        .rows()
        .iter()
        .map(|r| {
            off += r.n;
            flat[off - r.n..off].to_vec()
        })
        .collect()
}

fn check_sorted_padded(row: &[i32], m: usize) -> Result<(), TestCaseError> {
    let sel: Vec<i32> = row.iter().copied().take_while(|&x| x >= 0).collect();
    prop_assert_eq!(sel.len(), m.min(row.len()));
    prop_assert!(
        row[sel.len()..].iter().all(|&x| x == -1),
        "not -1 padded: {:?}",
        row
    );
    prop_assert!(
        sel.windows(2).all(|w| w[0] < w[1]),
        "not sorted ascending: {:?}",
        row
    );
    Ok(())
}

/// The consumer's batch of a source dump: the source's rows restricted to its tail.
fn consumer_batch(d: &Dump, batch: &Batch) -> Batch {
    match d.meta.tail {
        Some(t) => batch.tail(t).unwrap(),
        None => batch.clone(),
    }
}

proptest! {
    #![proptest_config(common::config(128))]

    /// Top-k equals a naive full sort under the ranking key (a consumer's: of the keys
    /// in its candidate blocks); rows are sorted, -1 padded; page follows k_slots and is -1 past K.
    #[test]
    fn topk_is_a_full_sort_and_page_follows_slots(d in case()) {
        let (batch, published) = common::strategies::batch_and_candidates(&d);
        let p = d.problem(&batch, published.as_ref()).unwrap();
        let scores = logits_by_row(&p);
        let out = reference::run(&p);
        for (i, row) in batch.rows().iter().enumerate() {
            // A consumer row ranks only the keys of its candidate blocks.
            let all: Vec<usize> = match &published {
                Some(pb) => {
                    let blocks = pb.blocks.row(i).to_vec();
                    candidates::consumer_candidates(&blocks, row.n, p.block_size).collect()
                }
                None => (0..row.n).collect(),
            };
            let want = topk::select_by_sort(&scores[i], &all, p.topk);
            let raw = out.raw.row(i).to_vec();
            check_sorted_padded(&raw, all.len())?;
            prop_assert_eq!(&raw[..want.len()], &want[..], "row {}", i);
            let page = out.page.row(i).to_vec();
            prop_assert_eq!(page.len(), p.page_cols);
            for (c, &j) in raw.iter().enumerate() {
                let expect = if j < 0 { -1 } else { p.slot(row, j as usize) };
                prop_assert_eq!(page[c], expect);
            }
            prop_assert!(page[p.topk..].iter().all(|&x| x == -1));
        }
    }

    /// The reference is bitwise the same for any thread count.
    #[test]
    fn thread_count_invariance(d in case(), threads in 2usize..5) {
        let (batch, published) = common::strategies::batch_and_candidates(&d);
        let p = d.problem(&batch, published.as_ref()).unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let many = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let (l1, o1) = one.install(|| (reference::logits(&p), reference::run(&p)));
        let (l2, o2) = many.install(|| (reference::logits(&p), reference::run(&p)));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&l1), bits(&l2));
        prop_assert_eq!(o1, o2);
    }

    /// Source rows: every kept block is visible, the pinned block is kept, at most NB
    /// blocks, ids ascending and -1 padded, and the kept set is the best by block score.
    /// A consumer's picks lie inside its blocks; with nb <= NB it equals a plain layer.
    #[test]
    fn candidate_blocks_and_consumers(mut s in shape()) {
        s.role = RoleKind::Source;
        let d = build(&s);
        let batch = d.batch().unwrap();
        let p = d.problem(&batch, None).unwrap();
        let scores = logits_by_row(&p);
        let out = reference::run(&p);
        let published = out.published.clone().unwrap();
        let pub_rows: Vec<usize> = (0..batch.num_rows()).filter(|&i| p.publishes(i)).collect();
        prop_assert_eq!(published.rows.len(), pub_rows.len());
        let (bs, nbmax) = (s.block_size, s.num_blocks);
        for (k, &i) in pub_rows.iter().enumerate() {
            let n = batch.rows()[i].n;
            let ids: Vec<i32> = published.blocks.row(k).to_vec();
            let kept: Vec<usize> = ids.iter().take_while(|&&c| c >= 0).map(|&c| c as usize).collect();
            if n == 0 {
                prop_assert!(kept.is_empty());
                continue;
            }
            let nb = n.div_ceil(bs);
            prop_assert_eq!(kept.len(), nb.min(nbmax));
            prop_assert!(ids[kept.len()..].iter().all(|&c| c == -1));
            prop_assert!(kept.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(kept.iter().all(|&c| c < nb), "a kept block is not visible");
            prop_assert!(kept.contains(&((n - 1) / bs)), "pinned block missing");
            // Best by block score: every dropped block is no better than every kept
            // non-pinned block.
            let key = |c: usize| scores[i][c * bs..((c + 1) * bs).min(n)].iter().map(|&x| rank_key(x)).max().unwrap();
            let pinned = (n - 1) / bs;
            for c in (0..nb).filter(|c| !kept.contains(c)) {
                for &kc in kept.iter().filter(|&&kc| kc != pinned) {
                    prop_assert!((key(kc), std::cmp::Reverse(kc)) > (key(c), std::cmp::Reverse(c)));
                }
            }
            // Dense view agrees.
            let dense = published.dense_row(k);
            for (j, &m) in dense.iter().enumerate() {
                prop_assert_eq!(m, kept.contains(&(j / bs)));
            }
        }
        // The consumer of this source.
        let cbatch = consumer_batch(&d, &batch);
        prop_assert_eq!(cbatch.num_rows(), pub_rows.len());
        let sub = sub_rows(&d, &pub_rows);
        let cp = Problem::new(&cbatch, sub.inputs(), Params { topk: s.topk, page_cols: None, block_size: bs, num_blocks: nbmax }, Role::Consumer(&published)).unwrap();
        let plain = Problem::new(&cbatch, sub.inputs(), Params { topk: s.topk, page_cols: None, block_size: bs, num_blocks: nbmax }, Role::Plain).unwrap();
        let co = reference::run(&cp);
        let po = reference::run(&plain);
        for (k, &i) in pub_rows.iter().enumerate() {
            let n = batch.rows()[i].n;
            let blocks = published.blocks.row(k).to_vec();
            let cands: Vec<usize> = candidates::consumer_candidates(&blocks, n, bs).collect();
            let picks: Vec<i32> = co.raw.row(k).iter().copied().take_while(|&x| x >= 0).collect();
            check_sorted_padded(&co.raw.row(k).to_vec(), cands.len())?;
            prop_assert!(picks.iter().all(|&j| cands.contains(&(j as usize))), "pick outside the blocks");
            prop_assert_eq!(picks, topk::select_by_sort(&scores[i], &cands, s.topk));
            if n.div_ceil(bs) <= nbmax {
                prop_assert_eq!(co.raw.row(k), po.raw.row(k));
                prop_assert_eq!(co.page.row(k), po.page.row(k));
            }
        }
    }
}

/// With small B and NB the restriction really removes keys: some consumer row has
/// fewer candidates than visible keys, and its picks differ from a plain layer's.
#[test]
fn small_blocks_really_restrict() {
    let mut removed = 0usize;
    let mut changed = 0usize;
    for seed in 0..20u64 {
        let s = Shape {
            block_size: 2,
            num_blocks: 3,
            role: RoleKind::Source,
            tail: Some(5),
            seed,
            ..Shape::fp4(vec![40, 33], vec![30, 0])
        };
        let d = build(&s);
        let batch = d.batch().unwrap();
        let p = d.problem(&batch, None).unwrap();
        let out = reference::run(&p);
        let published = out.published.unwrap();
        let pub_rows: Vec<usize> = (0..batch.num_rows()).filter(|&i| p.publishes(i)).collect();
        assert_eq!(pub_rows.len(), 10, "tail 5 of two requests");
        let cbatch = batch.tail(5).unwrap();
        let sub = sub_rows(&d, &pub_rows);
        let params = Params {
            topk: 4,
            page_cols: None,
            block_size: 2,
            num_blocks: 3,
        };
        let co = reference::run(
            &Problem::new(&cbatch, sub.inputs(), params, Role::Consumer(&published)).unwrap(),
        );
        let po = reference::run(&Problem::new(&cbatch, sub.inputs(), params, Role::Plain).unwrap());
        for k in 0..pub_rows.len() {
            let n = cbatch.rows()[k].n;
            let blocks = published.blocks.row(k).to_vec();
            let m = candidates::consumer_candidates(&blocks, n, 2).count();
            assert!(m <= 6);
            removed += n - m;
            changed += (co.raw.row(k) != po.raw.row(k)) as usize;
        }
    }
    assert!(removed > 0, "the restriction removed no key");
    assert!(changed > 0, "the restriction never changed a selection");
}

/// A fixed full-size case: n > 8 * 2048, so the model's B = 8, NB = 2048 restrict.
#[test]
fn full_size_source_and_consumer() {
    let s = Shape {
        topk: 2048,
        role: RoleKind::Source,
        seed: 7,
        ..Shape::fp4(vec![16_400], vec![16_397])
    };
    let d = build(&s);
    let batch = d.batch().unwrap();
    assert!(batch.rows().iter().all(|r| r.n > 8 * 2048));
    let p = d.problem(&batch, None).unwrap();
    let scores = logits_by_row(&p);
    let out = reference::run(&p);
    let published = out.published.clone().unwrap();
    let params = Params {
        topk: 2048,
        page_cols: None,
        block_size: 8,
        num_blocks: 2048,
    };
    let co = reference::run(
        &Problem::new(&batch, d.inputs(), params, Role::Consumer(&published)).unwrap(),
    );
    for (i, (row, s)) in batch.rows().iter().zip(&scores).enumerate() {
        let n = row.n;
        let all: Vec<usize> = (0..n).collect();
        assert_eq!(out.raw.row(i).to_vec(), topk::select_by_sort(s, &all, 2048));
        let blocks = published.blocks.row(i).to_vec();
        assert!(blocks.iter().all(|&c| c >= 0), "all 2048 blocks kept");
        let cands: Vec<usize> = candidates::consumer_candidates(&blocks, n, 8).collect();
        assert!(cands.len() < n, "blocks restrict");
        assert_eq!(
            co.raw.row(i).to_vec(),
            topk::select_by_sort(s, &cands, 2048)
        );
    }
}

/// The model's K values, with many exact ties (narrow alphabets) and page_cols > K.
#[test]
fn model_topk_values_with_ties_and_wide_pages() {
    for (k, seed) in [(512usize, 1u64), (1024, 2), (2048, 3)] {
        let s = Shape {
            topk: k,
            narrow: true,
            seed,
            ..Shape::fp4(vec![4100, 700], vec![4097, 698])
        };
        let d = build(&s);
        let batch = d.batch().unwrap();
        let params = Params {
            topk: k,
            page_cols: Some(k + 100),
            block_size: 8,
            num_blocks: 2048,
        };
        let p = Problem::new(&batch, d.inputs(), params, Role::Plain).unwrap();
        let scores = logits_by_row(&p);
        let out = reference::run(&p);
        assert_eq!(out.page.ncols(), k + 100);
        for (i, row) in batch.rows().iter().enumerate() {
            let distinct: std::collections::HashSet<u32> =
                scores[i].iter().map(|&x| rank_key(x)).collect();
            assert!(distinct.len() * 4 < row.n, "K={k}: ties should be heavy");
            let all: Vec<usize> = (0..row.n).collect();
            let want = topk::select_by_sort(&scores[i], &all, k);
            let raw = out.raw.row(i).to_vec();
            assert_eq!(&raw[..want.len()], &want[..], "K={k} row {i}");
            assert!(raw[want.len()..].iter().all(|&x| x == -1));
            let page = out.page.row(i).to_vec();
            assert!(
                page[want.len()..].iter().all(|&x| x == -1),
                "page past the selection is -1"
            );
        }
        assert_eq!(
            dsa_indexer::indexer::run_cpu(&p, 10_000).unwrap().0,
            out,
            "K={k} chunked"
        );
    }
}

/// The shared strategy really yields what the property tests above rely on: explicit
/// rows with duplicates and with gaps (positions of a request that no row takes between
/// positions that rows do take), and consumer layers whose candidates are given.
#[test]
fn the_strategy_yields_duplicate_and_gapped_rows_and_consumers() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut duplicates, mut gaps, mut consumers) = (0, 0, 0);
    for _ in 0..400 {
        let s = shape().new_tree(&mut runner).unwrap().current();
        let d = build(&s);
        let batch = d.batch().unwrap();
        if s.role == RoleKind::Consumer {
            let c = d
                .candidates
                .as_ref()
                .expect("a consumer carries candidates");
            assert_eq!(c.nrows(), batch.num_rows(), "one candidate row per row");
            consumers += 1;
        }
        let mut per_request = vec![Vec::new(); s.seq_lens.len()];
        for r in batch.rows() {
            per_request[r.request].push(r.position);
        }
        for mut pos in per_request {
            pos.sort_unstable();
            duplicates += pos.windows(2).any(|w| w[0] == w[1]) as usize;
            gaps += pos.windows(2).any(|w| w[1] > w[0] + 1) as usize;
        }
    }
    assert!(duplicates > 10, "{duplicates} requests with duplicate rows");
    assert!(gaps > 10, "{gaps} requests with gaps between rows");
    assert!(consumers > 50, "{consumers} consumer layers");
}
