//! SPEC 5: the ranking key, the per-row selection, index assembly.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Order-preserving key of a score: NaN counts as `-inf`, `-0.0` as `+0.0`,
/// otherwise IEEE order. Larger key = better.
#[inline]
pub fn rank_key(x: f32) -> u32 {
    let bits = if x.is_nan() {
        f32::NEG_INFINITY.to_bits()
    } else if x == 0.0 {
        0
    } else {
        x.to_bits()
    };
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Per-worker scratch of the selection: a heap of `K` packed entries and `K` ids.
#[derive(Debug, Default)]
pub struct Scratch {
    heap: BinaryHeap<Reverse<u64>>,
    ids: Vec<i32>,
}

impl Scratch {
    /// Scratch for `K = k`, allocated once.
    pub fn new(k: usize) -> Self {
        Scratch {
            heap: BinaryHeap::with_capacity(k),
            ids: Vec::with_capacity(k),
        }
    }

    /// Heap bytes one `Scratch::new(k)` holds: the top-k heap (8 bytes an entry).
    pub fn heap_bytes(k: usize) -> usize {
        k.saturating_mul(8)
    }

    /// Bytes of the assembled, sorted ids (4 bytes an entry).
    pub fn ids_bytes(k: usize) -> usize {
        k.saturating_mul(4)
    }
}

/// Select from `candidates` (request-local key ids, ascending) with `scores[j]`:
/// all of them when there are at most `k`, else the `k` best by (key desc, j asc).
/// Returns the selected ids sorted ascending.
pub fn select<'s>(
    scores: &[f32],
    candidates: impl Iterator<Item = usize> + Clone,
    k: usize,
    s: &'s mut Scratch,
) -> &'s [i32] {
    s.ids.clear();
    s.heap.clear();
    if candidates.clone().nth(k).is_none() {
        // m <= K: select all, read no score.
        s.ids.extend(candidates.map(|j| j as i32));
        return &s.ids;
    }
    // A min-heap of the k best so far. A u64 packs (key, !j) so that one integer
    // comparison is SPEC 5's total order (larger = better).
    let pack = |j: usize| ((rank_key(scores[j]) as u64) << 32) | (!(j as u32)) as u64;
    for j in candidates {
        let e = pack(j);
        if s.heap.len() < k {
            s.heap.push(Reverse(e));
        } else if let Some(mut worst) = s.heap.peek_mut() {
            if e > worst.0 {
                *worst = Reverse(e);
            }
        }
    }
    s.ids
        .extend(s.heap.iter().map(|&Reverse(e)| !(e as u32) as i32));
    s.ids.sort_unstable();
    &s.ids
}

/// Naive selection by a full sort under the ranking key (tests, fuzzing).
pub fn select_by_sort(scores: &[f32], candidates: &[usize], k: usize) -> Vec<i32> {
    let mut c: Vec<usize> = candidates.to_vec();
    if c.len() > k {
        c.sort_by(|&a, &b| {
            rank_key(scores[b])
                .cmp(&rank_key(scores[a]))
                .then(a.cmp(&b))
        });
        c.truncate(k);
    }
    c.sort_unstable();
    c.into_iter().map(|j| j as i32).collect()
}
