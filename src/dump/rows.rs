//! A dump cut to some of its rows (`replay --rows`, `--request`).

use std::collections::HashMap;

use ndarray::{Array2, Array3, Axis};

use super::derr;
use super::schema::{Dump, Expected, Layout, QData};
use crate::batch::Batch;
use crate::error::{Error, Result};

/// The visible logits of rows `sel`, from all rows' `flat` (`[sum n]`).
fn select_logits(batch: &Batch, flat: Option<&[f32]>, sel: &[usize]) -> Result<Option<Vec<f32>>> {
    let Some(l) = flat else {
        return Ok(None);
    };
    let mut off = Vec::with_capacity(batch.num_rows() + 1);
    off.push(0usize);
    for r in batch.rows() {
        off.push(off[off.len() - 1] + r.n);
    }
    let total = off[off.len() - 1];
    if l.len() != total {
        return Err(derr(
            "expected_logits",
            format!("{} values, expected sum n = {total}", l.len()),
        ));
    }
    Ok(Some(
        sel.iter()
            .flat_map(|&i| l[off[i]..off[i + 1]].iter().copied())
            .collect(),
    ))
}

impl Dump {
    /// The dump restricted to rows `sel` of `batch` (the dump's batch), in that order:
    /// an explicit layout, and every per-row tensor (expected ones included) cut to
    /// those rows. Published rows keep those among `sel`, renumbered.
    pub fn select_rows(&self, batch: &Batch, sel: &[usize]) -> Result<Dump> {
        let t = batch.num_rows();
        if let Some(&i) = sel.iter().find(|&&i| i >= t) {
            return Err(Error::range("rows", i, "rows of the dump"));
        }
        let rows_of = |name: &str, shape: &[usize]| -> Result<()> {
            if shape.first() != Some(&t) {
                return Err(derr(name, format!("shape {shape:?}, expected {t} rows")));
            }
            Ok(())
        };
        let rows3 = |name: &str, a: &Array3<u8>| -> Result<Array3<u8>> {
            rows_of(name, a.shape())?;
            Ok(a.select(Axis(0), sel))
        };
        let rows2 = |name: &str, a: &Option<Array2<i32>>| -> Result<Option<Array2<i32>>> {
            a.as_ref()
                .map(|a| rows_of(name, a.shape()).map(|_| a.select(Axis(0), sel)))
                .transpose()
        };
        let pick = |name: &str, v: &Option<Vec<i32>>| -> Result<Option<Vec<i32>>> {
            v.as_ref()
                .map(|v| rows_of(name, &[v.len()]).map(|_| sel.iter().map(|&i| v[i]).collect()))
                .transpose()
        };
        let q = match &self.q {
            QData::E4m3(q) => QData::E4m3(rows3("q", q)?),
            QData::E2m1 { packed, scale } => QData::E2m1 {
                packed: rows3("q", packed)?,
                scale: rows3("q_scale", scale)?,
            },
        };
        rows_of("weights", self.weights.shape())?;
        let e = &self.expected;
        let (published, published_rows) = match (&e.published, &e.published_rows) {
            (Some(pb), Some(pr)) => {
                let pos: HashMap<usize, usize> = sel
                    .iter()
                    .enumerate()
                    .map(|(new, &old)| (old, new))
                    .collect();
                let keep: Vec<(usize, i32)> = pr
                    .iter()
                    .enumerate()
                    .filter_map(|(k, &r)| {
                        let new = pos.get(&usize::try_from(r).ok()?)?;
                        Some((k, *new as i32))
                    })
                    .collect();
                if let Some(&(k, _)) = keep.iter().find(|x| x.0 >= pb.nrows()) {
                    return Err(derr(
                        "expected_published_rows",
                        format!("entry {k}: expected_published has {} rows", pb.nrows()),
                    ));
                }
                (
                    Some(pb.select(Axis(0), &keep.iter().map(|x| x.0).collect::<Vec<_>>())),
                    Some(keep.iter().map(|x| x.1).collect()),
                )
            }
            _ => (None, None),
        };
        Ok(Dump {
            meta: self.meta.clone(),
            seq_lens: self.seq_lens.clone(),
            layout: Layout::Explicit {
                requests: sel.iter().map(|&i| batch.rows()[i].request).collect(),
                positions: sel.iter().map(|&i| batch.rows()[i].position).collect(),
            },
            q,
            k: self.k.clone(),
            weights: self.weights.select(Axis(0), sel),
            k_slots: self.k_slots.clone(),
            candidates: rows2("candidates", &self.candidates)?,
            engine_logits: match &self.engine_logits {
                Some(a) => {
                    rows_of("engine_logits", a.shape())?;
                    Some(a.select(Axis(0), sel))
                }
                None => None,
            },
            expected: Expected {
                ks: pick("expected_ks", &e.ks)?,
                ke: pick("expected_ke", &e.ke)?,
                logits: select_logits(batch, e.logits.as_deref(), sel)?,
                raw: rows2("expected_raw", &e.raw)?,
                page: rows2("expected_page", &e.page)?,
                published,
                published_rows,
            },
        })
    }
}

/// The rows of `batch` that a replay of rows `a..b` and of request `r` keeps, in the
/// dump's numbering (`replay --rows`, `--request`; `None`: no restriction). The caller
/// has checked that `a..b` lies inside the rows and `r` is a request.
pub fn kept_rows(
    batch: &Batch,
    rows: Option<(usize, usize)>,
    request: Option<usize>,
) -> Vec<usize> {
    (0..batch.num_rows())
        .filter(|&i| rows.is_none_or(|(a, b)| (a..b).contains(&i)))
        .filter(|&i| request.is_none_or(|r| batch.rows()[i].request == r))
        .collect()
}

/// The default logits budget of a replay: a 32nd of the dump's logits, between 16 MiB
/// and 256 MiB, so that progress shows (the outputs do not depend on it).
pub fn replay_budget(batch: &Batch) -> usize {
    let logits: usize = batch
        .rows()
        .iter()
        .map(|r| r.n.div_ceil(4) * 16)
        .fold(0, usize::saturating_add);
    (logits / 32).clamp(16 << 20, 256 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dump::{KData, Meta};
    use ndarray::Array1;

    fn dump() -> Dump {
        let (t, l) = (3, 4);
        Dump {
            meta: Meta::plain_e4m3_h8_d32(2),
            seq_lens: vec![4],
            layout: Layout::Contiguous(vec![1]),
            q: QData::E4m3(Array3::from_shape_fn((t, 8, 32), |(i, _, _)| {
                0x30 + i as u8
            })),
            k: KData::E4m3 {
                codes: Array2::from_elem((l, 32), 0x38),
                scale: Array1::from_elem(l, 1.0),
            },
            weights: Array2::from_shape_fn((t, 8), |(i, _)| i as f32),
            k_slots: None,
            candidates: None,
            engine_logits: None,
            expected: Expected {
                ks: Some(vec![0, 0, 0]),
                ke: Some(vec![2, 3, 4]),
                logits: Some((0..9).map(|x| x as f32).collect()),
                ..Expected::default()
            },
        }
    }

    #[test]
    fn selected_rows_keep_their_positions_and_expected_values() {
        let d = dump();
        let b = d.batch().unwrap();
        let s = d.select_rows(&b, &[2, 0]).unwrap();
        assert_eq!(
            s.layout,
            Layout::Explicit {
                requests: vec![0, 0],
                positions: vec![3, 1],
            }
        );
        assert_eq!(s.expected.ke, Some(vec![4, 2]));
        // Row 0 sees keys 0..2 (logits 0, 1), row 2 keys 0..4 (logits 5..9).
        assert_eq!(s.expected.logits, Some(vec![5.0, 6.0, 7.0, 8.0, 0.0, 1.0]));
        assert_eq!(s.weights.column(0).to_vec(), vec![2.0, 0.0]);
        s.batch().unwrap();
    }

    #[test]
    fn a_row_outside_the_dump_or_a_short_tensor_is_an_error() {
        let d = dump();
        let b = d.batch().unwrap();
        assert!(matches!(
            d.select_rows(&b, &[3]),
            Err(Error::OutOfRange { ref field, .. }) if field == "rows"
        ));
        let mut short = d.clone();
        short.expected.ks = Some(vec![0, 0]);
        assert!(matches!(
            short.select_rows(&b, &[2]),
            Err(Error::Dump { ref tensor, .. }) if tensor == "expected_ks"
        ));
        let mut short = d;
        short.expected.logits.as_mut().unwrap().pop();
        assert!(matches!(
            short.select_rows(&b, &[0]),
            Err(Error::Dump { ref tensor, .. }) if tensor == "expected_logits"
        ));
    }
}
