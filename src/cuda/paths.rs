//! The path counters a run reads back from the device: which top-k path each row
//! selection took ([`TopkPaths`]) and on which side of the scale-folding edges the
//! exact-class logits kernels fell, and on which side of the int8 guard
//! `mqa_logits_wgi8`'s tiles ([`FoldCounts`]). Both are named `u64` counts of the
//! kernels' `u32` counters, in the kernels' order, and share one implementation.

/// A path-counter struct: named `u64` counts, in the order of the kernels' counters.
macro_rules! path_counters {
    (
        $(#[$doc:meta])*
        pub struct $name:ident {
            $( $(#[$field_doc:meta])* pub $field:ident: u64, )+
        }
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct $name {
            $( $(#[$field_doc])* pub $field: u64, )+
        }

        impl $name {
            /// How many counters the kernels keep for this struct.
            #[cfg(test)]
            const LEN: usize = [$(stringify!($field)),+].len();

            /// Each count over `runs` (counters summed over repeated runs of one problem).
            pub fn per_run(self, runs: u64) -> $name {
                let d = |x: u64| x / runs.max(1);
                $name {
                    $( $field: d(self.$field), )+
                }
            }

            /// The counts from the device's counters `c`, the first of `c` to the first
            /// field and so on.
            pub(super) fn from_device(c: &[u32]) -> $name {
                let mut c = c.iter().map(|&x| u64::from(x));
                $name {
                    $( $field: c.next().unwrap_or(0), )+
                }
            }
        }
    };
}

path_counters! {
    /// How many row selections each top-k path made in a run (read back by
    /// [`Backend::end`](crate::indexer::Backend::end); a row split into segments counts
    /// once per segment and once for the merge). Tests assert with it which path their
    /// rows took.
    pub struct TopkPaths {
        /// At most `K` candidates: every one taken, no score compared.
        pub all: u64,
        /// The row's keys in shared memory (rows of at most [`super::kernels::TOPK_SHORT_CAP`] keys).
        pub short: u64,
        /// Sampled threshold: one pass over the row.
        pub sampled: u64,
        /// Two passes: an 11-bit histogram, then the threshold bin in shared memory.
        pub two_pass: u64,
        /// Four digit passes over the row (K above the fast path's cap, or a crowded bin).
        pub general: u64,
        /// Sampled threshold whose first pass missed: a second pass at a rank corrected
        /// by the first pass's count.
        pub resampled: u64,
    }
}

path_counters! {
    /// What the exact-class logits kernels did in a run (read back by
    /// [`Backend::end`](crate::indexer::Backend::end); zero outside the exact class).
    /// Tests assert with it on which side of the scale-folding edges a launch fell
    /// (`kernels/logits_common.cuh`).
    pub struct FoldCounts {
        /// Blocks whose queries folded their scales into the MMA operands.
        pub query_blocks_folded: u64,
        /// Blocks whose queries did not.
        pub query_blocks_plain: u64,
        /// Threads whose key tiles all ran one multiply per group: folded key tiles, or, in
        /// `mqa_logits_wgr`, each key's `C = 2^(ebq_g - 129) * 2^(ek - 127)`.
        pub threads_one_multiply: u64,
        /// Threads of which some key tile ran the reference's two multiplies.
        pub threads_two_multiplies: u64,
        /// `mqa_logits_wgi8` (the exact class at `H = 32`, `D >= 64`): key tiles (per
        /// block) that passed the guard and ran one `s8` chain and the int8 head epilogue.
        pub tiles_int8: u64,
        /// `mqa_logits_wgi8`: key tiles (per block) the guard sent to `mqa_logits_wgr`'s
        /// tile.
        pub tiles_int8_fallback: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels;
    use super::*;

    /// One field per counter of the kernels, in their order.
    #[test]
    fn one_field_per_kernel_counter() {
        assert_eq!(TopkPaths::LEN, kernels::TOPK_PATHS.len());
        assert_eq!(FoldCounts::LEN, kernels::LOGITS_PATHS.len());
        let c = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        assert_eq!(
            TopkPaths::from_device(&c),
            TopkPaths {
                all: 1,
                short: 2,
                sampled: 3,
                two_pass: 4,
                general: 5,
                resampled: 6,
            }
        );
        assert_eq!(
            FoldCounts::from_device(&c[kernels::TOPK_PATHS.len()..]),
            FoldCounts {
                query_blocks_folded: 7,
                query_blocks_plain: 8,
                threads_one_multiply: 9,
                threads_two_multiplies: 10,
                tiles_int8: 11,
                tiles_int8_fallback: 12,
            }
        );
    }

    #[test]
    fn per_run_divides_every_count() {
        let p = TopkPaths {
            all: 12,
            short: 24,
            sampled: 36,
            two_pass: 48,
            general: 60,
            resampled: 72,
        };
        assert_eq!(
            p.per_run(12),
            TopkPaths {
                all: 1,
                short: 2,
                sampled: 3,
                two_pass: 4,
                general: 5,
                resampled: 6,
            }
        );
        assert_eq!(p.per_run(0), p);
    }
}
