//! The deliberate defects a case may carry, and how each is applied: to the batch
//! layout, the parameters, the input tensors or a consumer's published candidates.
//! A case that carries one must be answered with the crate's error type.

use ndarray::{Array1, Array2};

use dsa_indexer::batch::Batch;
use dsa_indexer::problem::Params;
use dsa_indexer::problem::Published;

use super::spec::Layout;
use super::synth::{Owned, OwnedKeys};
use crate::Rng;

/// The defects a case may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// An E4M3 NaN code in q or k.
    NanCode,
    /// UE8M0 byte 255.
    Scale255,
    /// A non-finite weight.
    BadWeight,
    /// A key scale that is not finite and positive.
    BadKscale,
    /// A negative slot.
    NegativeSlot,
    /// Weights with one row too many.
    WeightsShape,
    /// `K = 0`.
    ZeroTopk,
    /// `page_cols = K - 1`.
    NarrowPage,
    /// `B = 0`.
    ZeroBlock,
    /// `NB = 0`.
    ZeroBlocks,
    /// `tail = 0`.
    ZeroTail,
    /// Budget 0.
    ZeroBudget,
    /// Ratio 0.
    ZeroRatio,
    /// `query_start > seq_len`, or an explicit position `>= seq_len`.
    RowOutOfRange,
    /// A consumer block id out of range.
    BadCandidate,
    /// A consumer missing its last row.
    MissingCandidateRow,
}

pub(super) const DEFECTS: [Defect; 16] = [
    Defect::NanCode,
    Defect::Scale255,
    Defect::BadWeight,
    Defect::BadKscale,
    Defect::NegativeSlot,
    Defect::WeightsShape,
    Defect::ZeroTopk,
    Defect::NarrowPage,
    Defect::ZeroBlock,
    Defect::ZeroBlocks,
    Defect::ZeroTail,
    Defect::ZeroBudget,
    Defect::ZeroRatio,
    Defect::RowOutOfRange,
    Defect::BadCandidate,
    Defect::MissingCandidateRow,
];

/// Apply an input defect; returns whether it took effect (a non-empty tensor was hit).
pub(super) fn corrupt_inputs(d: Defect, rng: &mut Rng, q: &mut Owned, k: &mut OwnedKeys) -> bool {
    fn hit<T: Copy>(a: &mut [T], v: T, rng: &mut Rng) -> bool {
        if a.is_empty() {
            return false;
        }
        let i = rng.below(a.len());
        a[i] = v;
        true
    }
    match d {
        Defect::NanCode => {
            let nan = if rng.next() & 1 == 0 { 0x7F } else { 0xFF };
            let qhit = q.q_scale.is_none() && hit(q.q.as_slice_mut().unwrap(), nan, rng);
            let khit = k.kscale.is_some() && hit(k.k.as_slice_mut().unwrap(), nan, rng);
            qhit || khit
        }
        Defect::Scale255 => {
            let qhit = q
                .q_scale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), 255, rng));
            let khit = k
                .k_scale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), 255, rng));
            qhit || khit
        }
        Defect::BadWeight => {
            let v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)];
            hit(q.w.as_slice_mut().unwrap(), v, rng)
        }
        Defect::BadKscale => {
            let v = [f32::NAN, f32::INFINITY, 0.0, -0.0, -1.0][rng.below(5)];
            k.kscale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), v, rng))
        }
        Defect::NegativeSlot => {
            let l = k.k.nrows();
            let mut slots = k
                .slots
                .take()
                .unwrap_or_else(|| Array1::from_shape_fn(l, |x| x as i32));
            let v = -1 - rng.below(1 << 30) as i32;
            let took = hit(slots.as_slice_mut().unwrap(), v, rng);
            k.slots = Some(slots);
            took
        }
        Defect::WeightsShape => {
            let (t, h) = q.w.dim();
            q.w = Array2::from_elem((t + 1, h), 1.0);
            true
        }
        _ => false,
    }
}

/// Apply a batch defect to the layout; returns whether the batch must now be rejected.
pub(super) fn corrupt_layout(d: Option<Defect>, rng: &mut Rng, lay: &mut Layout) -> bool {
    match d {
        Some(Defect::ZeroRatio) => {
            lay.ratio = 0;
            true
        }
        Some(Defect::RowOutOfRange) => match &mut lay.explicit {
            Some((reqs, pos)) if !reqs.is_empty() => {
                let i = rng.below(reqs.len());
                pos[i] = lay.seq_lens[reqs[i]] + rng.below(3);
                true
            }
            Some(_) => false,
            None if !lay.seq_lens.is_empty() => {
                let b = rng.below(lay.seq_lens.len());
                lay.query_starts[b] = lay.seq_lens[b] + 1 + rng.below(3);
                true
            }
            None => false,
        },
        _ => false,
    }
}

/// Apply a parameter defect (`role_sel`: the spec's role, 0 plain); returns whether
/// the problem must now be rejected. Budget 0 is not the problem's to reject: the
/// run answers it.
pub(super) fn corrupt_params(
    d: Option<Defect>,
    role_sel: u8,
    params: &mut Params,
    tail: &mut Option<usize>,
    budgets: &mut [usize; 2],
) -> bool {
    match d {
        Some(Defect::ZeroTopk) => params.topk = 0,
        Some(Defect::NarrowPage) => params.page_cols = Some(params.topk - 1),
        Some(Defect::ZeroBlock) => params.block_size = 0,
        Some(Defect::ZeroBlocks) => params.num_blocks = 0,
        Some(Defect::ZeroTail) if role_sel != 0 => *tail = Some(0),
        Some(Defect::ZeroBudget) => *budgets = [0, 0],
        _ => {}
    }
    matches!(
        d,
        Some(Defect::ZeroTopk | Defect::NarrowPage | Defect::ZeroBlock | Defect::ZeroBlocks)
    ) || (d == Some(Defect::ZeroTail) && role_sel != 0)
}

/// Apply a candidate defect to the source's published candidates for the consumer
/// batch `cbatch`; returns whether it took effect.
pub(super) fn corrupt_candidates(
    d: Option<Defect>,
    rng: &mut Rng,
    published: &mut Published,
    cbatch: &Batch,
    params: &Params,
) -> bool {
    let t = published.rows.len();
    match d {
        Some(Defect::BadCandidate) if t > 0 => {
            let i = rng.below(t);
            let row = cbatch.rows()[i];
            let nb = row.n.div_ceil(params.block_size.max(1));
            let c = rng.below(params.num_blocks.max(1));
            published.blocks[[i, c]] = nb as i32 + rng.below(4) as i32;
            true
        }
        Some(Defect::MissingCandidateRow) if t > 0 => {
            published.rows.pop();
            published.blocks = published.blocks.slice(ndarray::s![..t - 1, ..]).to_owned();
            true
        }
        _ => false,
    }
}
