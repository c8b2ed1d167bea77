//! The committed seed cases of `chunked_vs_reference` and `cuda_vs_reference`.

use super::defect::DEFECTS;
use super::spec::Spec;

/// Seeds: the property tests' boundary cases (SPEC 3 worked example, `n` around `K`
/// and `B * NB`, empty and one-row requests, explicit rows, every format pair, role and
/// ratio, ties, tiny budgets), as `(name, spec)`.
pub fn seeds() -> Vec<(String, Spec)> {
    let base = Spec {
        seed: 7,
        ..Spec::default()
    };
    let mut out = Vec::new();
    let mut push = |name: String, s: Spec| out.push((name, s));
    // SPEC 3's worked example: seq_lens [10, 4], query_starts [7, 2], ratios 1 and 2.
    for ratio in [0u8, 1] {
        push(
            format!("spec3_example_r{}", ratio + 1),
            Spec {
                ratio,
                n_requests: 0,
                requests: [(10, 3), (4, 2), (0, 0), (0, 0)],
                ..base.clone()
            },
        );
    }
    // Format pairs x roles x ratios, n around K = 8 and B * NB = 4 * 3 = 12, ties.
    for (f, (qf, kf)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        for role in 0u8..3 {
            for (ri, ratio) in [0u8, 1, 3].into_iter().enumerate() {
                for narrow in [false, true] {
                    let pal = |v: [u8; 8]| if narrow { (3, v) } else { (0, v) };
                    push(
                        format!(
                            "fmt{f}_role{role}_r{ri}_{}",
                            if narrow { "ties" } else { "wide" }
                        ),
                        Spec {
                            ratio,
                            n_requests: 2,
                            requests: [(13, 13), (8, 8), (0, 0), (1, 1)],
                            q_fp4: qf,
                            k_fp4: kf,
                            q_palette: pal([0x38, 0x30, 0xB8, 0, 0, 0, 0, 0]),
                            k_palette: pal([0x38, 0x40, 0x22, 0, 0, 0, 0, 0]),
                            scale_palette: (1, [127, 0, 0, 0, 0, 0, 0, 0]),
                            topk: 7,
                            block_size: 3,
                            num_blocks: 2,
                            role,
                            tail: (role != 0).then_some(4),
                            budgets: [17, 64],
                            threads: role + ratio,
                            ..base.clone()
                        },
                    );
                }
            }
        }
    }
    // Explicit rows, duplicates, k_slots, page_cols > K, wide heads and dims.
    for (i, (heads, dim)) in [(7u8, 3u8), (6, 2), (4, 1), (0, 0)].into_iter().enumerate() {
        push(
            format!("explicit_h{heads}_d{dim}"),
            Spec {
                n_requests: 3,
                requests: [(17, 5), (40, 0), (3, 3), (0, 0)],
                explicit: 1,
                n_explicit: 12 + i as u8,
                heads,
                dim,
                slots: true,
                page_extra: Some(3),
                topk: 2,
                budgets: [4, 1],
                role: i as u8 % 3,
                tail: Some(1),
                ..base.clone()
            },
        );
    }
    // Overflow to infinity and NaN logits: huge weights and key scales, extreme UE8M0.
    push(
        "overflow_inf_nan".into(),
        Spec {
            n_requests: 1,
            requests: [(24, 24), (0, 0), (0, 0), (0, 0)],
            w_palette: (4, [3e38, -3e38, 0.0, -0.0]),
            kscale_palette: (2, [3e38, 1e-45, 0.0, 0.0]),
            scale_palette: (3, [254, 1, 0, 0, 0, 0, 0, 0]),
            topk: 5,
            block_size: 2,
            num_blocks: 3,
            role: 1,
            ..base.clone()
        },
    );
    // One defect of each kind.
    for d in 0..DEFECTS.len() as u8 {
        push(
            format!("defect_{d:02}"),
            Spec {
                corrupt: 48 + d,
                n_requests: 0,
                requests: [(12, 6), (9, 9), (0, 0), (0, 0)],
                role: [0, 1, 2, 2][d as usize % 4],
                tail: Some(3),
                explicit: (d == 13) as u8,
                n_explicit: 5,
                ..base.clone()
            },
        );
    }
    out
}
