//! The driver of one case: build the batch, parameters and inputs from a [`Spec`],
//! apply its defect, validate, run the reference and the backend under each budget,
//! and compare them with the oracle's checks.

use dsa_indexer::batch::Batch;
use dsa_indexer::problem::{Params, Problem, Role};
use dsa_indexer::reference::{self, Output};

use super::defect::{corrupt_candidates, corrupt_inputs, corrupt_layout, corrupt_params, Defect};
use super::oracle::{
    check_layout, check_logits, check_output, check_plan, check_selection, select_from_scores,
};
use super::spec::{Layout, Spec};
use super::subject::Subject;
use super::synth::{inputs, Owned, OwnedKeys};
use crate::{kind, Rng, STATS};

/// What a case decided before its problems are built.
struct Case<'a> {
    spec: &'a Spec,
    defect: Option<Defect>,
    batch: Batch,
    lay: Layout,
    params: Params,
    tail: Option<usize>,
    budgets: [usize; 2],
}

/// Build the case, run the reference and `backend` (under each budget), compare.
/// Panics on any disagreement, on a valid case the crate rejects, and on a defect it
/// accepts. Counts the outcome in [`STATS`].
pub fn check(spec: &Spec, backend: &mut dyn Subject) {
    let defect = spec.defect();
    let mut rng = Rng(spec.seed);
    let Some((batch, lay)) = batch_of(spec, defect, &mut rng) else {
        return;
    };
    let (h, d) = (lay.heads, lay.dim);
    let mut params = spec.params();
    let mut tail = spec.tail();
    let mut budgets = spec.budgets();
    let mut src_q = spec.queries(&mut rng, batch.num_rows(), h, d);
    let mut keys = spec.keys(&mut rng, batch.num_keys(), d);
    let role_sel = spec.role % 3;
    // Defects the problem itself must reject.
    let mut bad_problem = corrupt_params(defect, role_sel, &mut params, &mut tail, &mut budgets);
    let case = Case {
        spec,
        defect,
        batch,
        lay,
        params,
        tail,
        budgets,
    };
    if role_sel == 2 {
        check_consumer(&case, &mut rng, &src_q, &mut keys, bad_problem, backend);
        return;
    }
    if let Some(d) = defect {
        bad_problem |= corrupt_inputs(d, &mut rng, &mut src_q, &mut keys);
    }
    let role = if role_sel == 0 {
        Role::Plain
    } else {
        Role::Source { tail }
    };
    let p = match Problem::new(&case.batch, inputs(&src_q, &keys), params, role) {
        Ok(p) => {
            assert!(!bad_problem, "defect {defect:?} accepted: {spec:?}");
            p
        }
        Err(e) => {
            assert!(bad_problem, "valid problem rejected: {e} ({spec:?})");
            STATS.note(format!("problem:{}", kind(&e)));
            return;
        }
    };
    if compare(&p, budgets, spec.threads, backend) {
        STATS.reached();
    }
}

/// The case's batch after any batch defect, checked against SPEC 3; `None` when the
/// batch was (rightly) rejected.
fn batch_of(spec: &Spec, defect: Option<Defect>, rng: &mut Rng) -> Option<(Batch, Layout)> {
    let mut lay = spec.layout();
    let expect_err = corrupt_layout(defect, rng, &mut lay);
    let batch = match &lay.explicit {
        Some((reqs, pos)) => Batch::explicit(&lay.seq_lens, reqs, pos, lay.ratio),
        None => Batch::contiguous(&lay.seq_lens, &lay.query_starts, lay.ratio),
    };
    match batch {
        Ok(b) => {
            assert!(
                !expect_err,
                "defect {defect:?} accepted by the batch: {lay:?}"
            );
            check_layout(&b);
            Some((b, lay))
        }
        Err(e) => {
            assert!(expect_err, "valid batch rejected: {e} ({lay:?})");
            STATS.note(format!("batch:{}", kind(&e)));
            None
        }
    }
}

/// Consumer: the source runs on the same batch and keys, then the consumer runs on
/// the tail batch with its own queries and weights.
fn check_consumer(
    c: &Case,
    rng: &mut Rng,
    src_q: &Owned,
    keys: &mut OwnedKeys,
    mut bad_problem: bool,
    backend: &mut dyn Subject,
) {
    let (spec, defect, params) = (c.spec, c.defect, c.params);
    let src = Problem::new(
        &c.batch,
        inputs(src_q, keys),
        params,
        Role::Source { tail: c.tail },
    );
    let src = match src {
        Ok(p) => p,
        Err(e) => {
            assert!(bad_problem, "valid source rejected: {e} ({spec:?})");
            STATS.note(format!("source:{}", kind(&e)));
            return;
        }
    };
    let mut published = reference::run(&src).published.expect("a source publishes");
    let cbatch = tail_batch(c, &published.rows);
    let mut cq = spec.queries(rng, cbatch.num_rows(), c.lay.heads, c.lay.dim);
    if let Some(d) = defect {
        bad_problem |= corrupt_inputs(d, rng, &mut cq, keys);
    }
    bad_problem |= corrupt_candidates(defect, rng, &mut published, &cbatch, &params);
    let p = match Problem::new(
        &cbatch,
        inputs(&cq, keys),
        params,
        Role::Consumer(&published),
    ) {
        Ok(p) => {
            assert!(!bad_problem, "defect {defect:?} accepted: {spec:?}");
            p
        }
        Err(e) => {
            assert!(bad_problem, "valid consumer rejected: {e} ({spec:?})");
            STATS.note(format!("consumer:{}", kind(&e)));
            return;
        }
    };
    if !compare(&p, c.budgets, spec.threads, backend) {
        return;
    }
    // SPEC 6: when every row keeps all its visible blocks, the consumer selects what a
    // plain layer would.
    let all_kept = cbatch
        .rows()
        .iter()
        .all(|r| r.n.div_ceil(p.block_size) <= p.num_blocks);
    if all_kept {
        let plain = Problem::new(&cbatch, inputs(&cq, keys), params, Role::Plain)
            .expect("the consumer's inputs are valid for a plain layer");
        assert_eq!(
            reference::run(&p).raw,
            reference::run(&plain).raw,
            "consumer keeping every block differs from a plain layer"
        );
    }
    STATS.reached();
}

/// The consumer's batch, with SPEC 6's rows checked independently: the source's rows
/// at `p >= S_b - tail`, in order, which are also the published rows.
fn tail_batch(c: &Case, published_rows: &[(usize, usize)]) -> Batch {
    let cbatch = match c.tail {
        Some(t) => c.batch.tail(t).expect("tail >= 1"),
        None => c.batch.clone(),
    };
    let want_rows: Vec<(usize, usize)> = c
        .batch
        .rows()
        .iter()
        .filter(|r| {
            c.tail
                .is_none_or(|t| r.position + t >= c.lay.seq_lens[r.request])
        })
        .map(|r| (r.request, r.position))
        .collect();
    let got_rows: Vec<(usize, usize)> = cbatch
        .rows()
        .iter()
        .map(|r| (r.request, r.position))
        .collect();
    assert_eq!(got_rows, want_rows, "tail batch rows");
    assert_eq!(published_rows, want_rows, "published rows");
    cbatch
}

/// Whether any budget got to the comparison: a budget of 0 is only checked to be an
/// error, and an input whose budgets are both 0 counts as skipped, not reached.
fn compare(p: &Problem, budgets: [usize; 2], threads: u8, backend: &mut dyn Subject) -> bool {
    let want = reference::run(p);
    check_output(p, &want);
    let want_logits = reference::logits(p);
    let bound = backend.bound(p);
    // The first budget's outputs and logits: SPEC 7 and 4 hold them bitwise across budgets.
    let mut first: Option<(Output, Option<Vec<f32>>)> = None;
    let mut compared = false;
    for budget in budgets {
        let got = backend.run(p, budget, threads);
        let logits = backend.logits(p, budget, threads);
        if budget == 0 {
            match got {
                Err(e) => STATS.note(format!("budget0:{}", kind(&e))),
                Ok(_) => panic!("budget 0 accepted"),
            }
            continue;
        }
        let mut own = None;
        for (name, l) in logits {
            let l = l.unwrap_or_else(|e| panic!("{name}: logits of a valid problem failed: {e}"));
            check_logits(p, &name, &l, &want_logits, bound);
            own.get_or_insert(l);
        }
        let (out, plan) = got.unwrap_or_else(|e| panic!("valid run failed: {e}"));
        check_plan(p, &plan, budget);
        match bound {
            // Bitwise logits: the reference's outputs.
            None => same_outputs(&out, &want, &format!("the reference (budget {budget})")),
            // Within a bound: SPEC 5's rule on the reference's scores, and the
            // reference's selection from the backend's own logits (SPEC 5: same scores,
            // same selection).
            Some(bound) => {
                check_output(p, &out);
                check_selection(p, &out, &want_logits, bound);
                if let Some(l) = &own {
                    let from_own = select_from_scores(p, l);
                    let what = format!("the selection from the backend's logits (budget {budget})");
                    same_outputs(&out, &from_own, &what);
                }
            }
        }
        compared = true;
        match &first {
            None => first = Some((out, own)),
            Some((out0, own0)) => {
                same_outputs(&out, out0, &format!("the first budget's (budget {budget})"));
                let bits = |l: &Option<Vec<f32>>| {
                    l.as_ref()
                        .map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                };
                assert!(
                    bits(&own) == bits(own0),
                    "logits differ between budgets (budget {budget})"
                );
            }
        }
    }
    if !compared {
        STATS.note("skipped:budget0".to_string());
    }
    compared
}

/// `raw`, `page` and published candidates bitwise equal to `want`'s.
fn same_outputs(out: &Output, want: &Output, what: &str) {
    assert_eq!(out.raw, want.raw, "raw differs from {what}");
    assert_eq!(out.page, want.page, "page differs from {what}");
    assert_eq!(
        out.published, want.published,
        "published candidates differ from {what}"
    );
}
