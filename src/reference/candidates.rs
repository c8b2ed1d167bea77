//! SPEC 6: block scores, the pinned block, the kept blocks of a source row, and the
//! candidate keys of a consumer row.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::topk::rank_key;

/// Block scores of a row: `out[c]` = ranking key of the best visible key of block `c`.
/// `out.len()` must be `ceil(n / B)`.
pub fn block_keys(scores: &[f32], n: usize, block_size: usize, out: &mut [u32]) {
    for (c, o) in out.iter_mut().enumerate() {
        let lo = c * block_size;
        let hi = (lo + block_size).min(n);
        *o = scores[lo..hi]
            .iter()
            .map(|&x| rank_key(x))
            .max()
            .unwrap_or(0);
    }
}

/// Kept blocks of a row with `n > 0` visible keys, from its block keys
/// (`ceil(n / B)` of them): the pinned block `(n - 1) / B`, then the best
/// `min(NB, nb) - 1` others by (key desc, index asc). Writes the ids ascending,
/// `-1`-padded, into `out` (`NB` wide). `heap` is scratch of `NB` entries.
pub fn kept_blocks(
    block_keys: &[u32],
    n: usize,
    block_size: usize,
    out: &mut [i32],
    heap: &mut BinaryHeap<Reverse<u64>>,
) {
    out.iter_mut().for_each(|x| *x = -1);
    if n == 0 || out.is_empty() {
        return;
    }
    let pinned = (n - 1) / block_size;
    let keep = out.len().min(block_keys.len()) - 1;
    // The best `keep` non-pinned blocks: a min-heap of packed (key, !index), so that
    // one integer comparison is the total order (larger = better).
    heap.clear();
    if keep > 0 {
        for (c, &key) in block_keys.iter().enumerate().filter(|&(c, _)| c != pinned) {
            let e = ((key as u64) << 32) | (!(c as u32)) as u64;
            if heap.len() < keep {
                heap.push(Reverse(e));
            } else if let Some(mut worst) = heap.peek_mut() {
                if e > worst.0 {
                    *worst = Reverse(e);
                }
            }
        }
    }
    out[0] = pinned as i32;
    for (o, &Reverse(e)) in out[1..].iter_mut().zip(heap.iter()) {
        *o = !(e as u32) as i32;
    }
    out[..=heap.len()].sort_unstable();
}

/// The candidate keys of a consumer row: visible keys `j < n` inside its kept blocks,
/// ascending. `blocks` is the published row (ascending ids, `-1`-padded).
pub fn consumer_candidates(
    blocks: &[i32],
    n: usize,
    block_size: usize,
) -> impl Iterator<Item = usize> + Clone + '_ {
    blocks.iter().take_while(|&&c| c >= 0).flat_map(move |&c| {
        let lo = (c as usize).saturating_mul(block_size).min(n);
        let hi = lo.saturating_add(block_size).min(n);
        lo..hi
    })
}
