//! `page` (pool slots, SPEC 5) against the expected `raw` ids, and the ids a `page`
//! names when a dump carries no `raw`.

use std::collections::HashMap;

use ndarray::Array2;

use super::selection::Ids;
use super::{Rows, Status, Tally};
use crate::problem::Problem;

/// `page` against the slots of the expected `raw` ids (the selection itself is judged
/// on `raw`): identical when it is SPEC 5's form of those slots, equal up to ties when
/// it holds the same slots otherwise placed (an order), else different.
pub(crate) fn page_vs_raw(ctx: &Rows, ids: &[Ids], page: &Array2<i32>) -> Tally {
    let p = ctx.p;
    let mut d = Tally {
        compared: page.nrows(),
        ..Default::default()
    };
    for (i, id) in ids.iter().enumerate() {
        let r = p.batch.rows()[i];
        let row = page.row(i);
        let ids = id.clone().unwrap_or_default();
        let slots: Vec<i32> = ids
            .iter()
            .map(|&j| if j < r.n { p.slot(&r, j) } else { -2 })
            .collect();
        let canonical = (0..p.page_cols).map(|c| slots.get(c).copied().unwrap_or(-1));
        if row.iter().copied().eq(canonical) {
            continue;
        }
        let mut have: Vec<i32> = row.iter().copied().filter(|&x| x != -1).collect();
        let mut want = slots.clone();
        have.sort_unstable();
        want.sort_unstable();
        let same_set = have == want;
        d.count(
            if same_set {
                Status::Ties
            } else {
                Status::Different
            },
            ctx.orig[i],
        );
        if d.notes.len() < ctx.max_show {
            d.notes.push(if same_set {
                format!(
                    "{}: page holds the slots of expected_raw in another order",
                    ctx.label(i)
                )
            } else {
                format!(
                    "{}: page slots {:?} are not the slots {:?} of expected_raw's keys",
                    ctx.label(i),
                    have,
                    want
                )
            });
        }
    }
    d
}

/// Expected request-local ids per row from `page` through the inverse slot map. A slot
/// can name several keys of one request (a page listed twice in its page table, SPEC 10
/// allows it): each occurrence takes the next of them, ascending.
pub fn ids_from_page(p: &Problem, page: &Array2<i32>) -> Vec<Ids> {
    (0..p.batch.num_rows())
        .map(|i| {
            let r = p.batch.rows()[i];
            let mut inv: HashMap<i32, Vec<usize>> = HashMap::new();
            for j in (0..r.n).rev() {
                inv.entry(p.slot(&r, j)).or_default().push(j);
            }
            let row = page.row(i);
            let slots = row.as_slice().unwrap_or(&[]);
            if let Some(c) = slots.iter().position(|&x| x < -1) {
                return Err(format!(
                    "column {c} = {}, expected a slot >= 0 or -1",
                    slots[c]
                ));
            }
            let mut js = Vec::new();
            for &s in slots.iter().filter(|&&x| x >= 0) {
                match inv.get_mut(&s).map(|v| v.pop()) {
                    Some(Some(j)) => js.push(j),
                    Some(None) => {
                        return Err(format!("slot {s} appears more often than keys have it"))
                    }
                    None => return Err(format!("slot {s} is not a visible key's slot")),
                }
            }
            js.sort_unstable();
            Ok(js)
        })
        .collect()
}
