//! Published candidate blocks (SPEC 6) against the reference, up to ties and the
//! selections' tolerance (a key score's error moves its block's score by no more).

use ndarray::Array2;

use super::bound::row_scores;
use super::selection::{abbrev, check_selection, parse_row};
use super::{RowMargin, Rows, Status, Tally};
use crate::reference::{rank_key, Output};

/// Compare published candidate blocks row by row (SPEC 6 up to ties and the tolerance).
/// `exp` is the dump's `[P, NB]`, `exp_rows` the rows that published them.
pub(crate) fn compare_published(
    ctx: &Rows,
    ours: &Output,
    exp: &Array2<i32>,
    exp_rows: &[usize],
) -> Tally {
    let p = ctx.p;
    let Some(pb) = &ours.published else {
        return Tally {
            different: 1,
            notes: vec!["the dump has expected_published but the layer is not a source".into()],
            ..Default::default()
        };
    };
    let our_rows: Vec<usize> = (0..p.batch.num_rows())
        .filter(|&i| p.publishes(i))
        .collect();
    let mut d = Tally {
        compared: exp.nrows(),
        ..Default::default()
    };
    if our_rows != exp_rows || exp.shape() != pb.blocks.shape() {
        d.different += 1;
        d.notes.push(format!(
            "published rows differ: expected {} rows {}, replayed {} rows {} (width {} vs {})",
            exp_rows.len(),
            abbrev(exp_rows, false),
            our_rows.len(),
            abbrev(&our_rows, false),
            exp.ncols(),
            pb.blocks.ncols()
        ));
        return d;
    }
    for (k, &i) in our_rows.iter().enumerate() {
        let (a, b) = (pb.blocks.row(k), exp.row(k));
        if a == b {
            continue;
        }
        let ours_set = parse_row(a.as_slice().unwrap_or(&[])).unwrap_or_default();
        let m = ctx.row_m(i);
        let tau = ctx.tau(i, m);
        let (status, need, why) = judge_blocks(ctx, i, &ours_set, b.as_slice().unwrap_or(&[]), tau);
        d.count(status, ctx.orig[i]);
        let margin = RowMargin::new(ctx.orig[i], status, need, tau, m);
        d.margins.push(margin);
        if d.notes.len() < ctx.max_show {
            let mut s = format!(
                "{}: published blocks {status}{}",
                ctx.label(i),
                margin.describe()
            );
            for w in why.iter().take(4) {
                s += &format!("\n      {w}");
            }
            d.notes.push(s);
        }
    }
    d
}

/// Row `i`'s expected blocks `exp` against the replayed set `ours`: the row's last
/// block pinned, the others a valid selection of block scores (each block's best
/// visible key) up to ties and the row's tolerance `tau`. Returns the status, the
/// tightest tolerance it needs (`None`: none passes) and the reasons of a difference.
fn judge_blocks(
    ctx: &Rows,
    i: usize,
    ours: &[usize],
    exp: &[i32],
    tau: f64,
) -> (Status, Option<f64>, Vec<String>) {
    let p = ctx.p;
    let n = p.batch.rows()[i].n;
    let bs = p.block_size;
    let e = match parse_row(exp) {
        Err(e) => return (Status::Different, None, vec![e]),
        Ok(e) if e == ours => return (Status::Ties, Some(0.0), Vec::new()),
        Ok(e) if n == 0 => {
            return (
                Status::Different,
                None,
                vec![format!(
                    "row has no visible keys, expected publishes {}",
                    abbrev(&e, false)
                )],
            )
        }
        Ok(e) => e,
    };
    let scores = row_scores(p, i);
    let nb = n.div_ceil(bs);
    // Block scores: the best visible key of each block.
    let block: Vec<f32> = (0..nb)
        .map(|c| {
            scores[c * bs..((c + 1) * bs).min(n)]
                .iter()
                .copied()
                .max_by_key(|&x| rank_key(x))
                .unwrap_or(f32::NEG_INFINITY)
        })
        .collect();
    let pinned = (n - 1) / bs;
    if e.binary_search(&pinned).is_err() {
        return (
            Status::Different,
            None,
            vec![format!("pinned block {pinned} not kept")],
        );
    }
    let others: Vec<usize> = (0..nb).filter(|&c| c != pinned).collect();
    let exp_others: Vec<usize> = e.iter().copied().filter(|&c| c != pinned).collect();
    let keep = p.num_blocks.min(nb) - 1;
    let j = check_selection(&block, &others, keep, &exp_others, "block");
    let status = j.status(tau);
    let why = if status == Status::Different {
        j.reasons(&block, tau, "block")
    } else {
        Vec::new()
    };
    (status, j.structural.is_empty().then_some(j.need), why)
}
