//! SPEC 8: every malformed input is a typed error naming the field and the value.

use dsa_indexer::batch::Batch;
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Published, Queries, Role};
use dsa_indexer::Error;
use ndarray::{Array1, Array2, Array3};

struct Owned {
    batch: Batch,
    q8: Array3<u8>,
    q4: Array3<u8>,
    qs: Array3<u8>,
    k8: Array2<u8>,
    kscale: Array1<f32>,
    k4: Array2<u8>,
    ks4: Array2<u8>,
    w: Array2<f32>,
    slots: Array1<i32>,
}

fn owned() -> Owned {
    let batch = Batch::contiguous(&[6, 3], &[2, 0], 1).unwrap();
    let (t, l, h, d) = (batch.num_rows(), batch.num_keys(), 8, 64);
    Owned {
        batch,
        q8: Array3::from_elem((t, h, d), 0x38),
        q4: Array3::from_elem((t, h, d / 2), 0x21),
        qs: Array3::from_elem((t, h, d / 32), 127),
        k8: Array2::from_elem((l, d), 0x30),
        kscale: Array1::from_elem(l, 0.5),
        k4: Array2::from_elem((l, d / 2), 0x12),
        ks4: Array2::from_elem((l, d / 32), 126),
        w: Array2::from_elem((t, h), 0.25),
        slots: Array1::from_shape_fn(l, |x| 100 + x as i32),
    }
}

impl Owned {
    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            q: Queries::E2m1 {
                packed: self.q4.view(),
                scale: self.qs.view(),
            },
            k: Keys::E4m3 {
                codes: self.k8.view(),
                scale: self.kscale.view(),
            },
            weights: self.w.view(),
            k_slots: Some(self.slots.view()),
        }
    }
    fn problem<'a>(
        &'a self,
        inputs: Inputs<'a>,
        params: Params,
        role: Role<'a>,
    ) -> Result<(), Error> {
        Problem::new(&self.batch, inputs, params, role).map(|_| ())
    }
    /// `problem` with K = 4, plain.
    fn plain<'a>(&'a self, inputs: Inputs<'a>) -> Result<(), Error> {
        self.problem(inputs, Params::new(4), Role::Plain)
    }
    /// K = 4 with candidate blocks of 2 keys, 2 kept per row.
    fn block_params() -> Params {
        Params {
            block_size: 2,
            num_blocks: 2,
            ..Params::new(4)
        }
    }
    /// What this batch publishes as a source layer with [`Owned::block_params`].
    fn published(&self) -> Published {
        let src = Problem::new(
            &self.batch,
            self.inputs(),
            Self::block_params(),
            Role::Source { tail: None },
        )
        .unwrap();
        run_cpu(&src, 1 << 20).unwrap().0.published.unwrap()
    }
}

/// The error's message must name `field` and show `value`.
fn names(r: Result<(), Error>, field: &str, value: &str) {
    let e = r.expect_err("expected an error");
    let m = e.to_string();
    assert!(
        m.contains(field) && m.contains(value),
        "message {m:?} should name {field:?} and {value:?}"
    );
}

#[test]
fn valid_baseline_passes() {
    let o = owned();
    o.problem(o.inputs(), Params::new(4), Role::Plain).unwrap();
    let inputs = Inputs {
        q: Queries::E4m3(o.q8.view()),
        k: Keys::E2m1 {
            packed: o.k4.view(),
            scale: o.ks4.view(),
        },
        ..o.inputs()
    };
    o.problem(inputs, Params::new(4), Role::Source { tail: Some(2) })
        .unwrap();
}

#[test]
fn shapes_heads_and_dims() {
    let o = owned();
    let bad_q = Array3::<u8>::from_elem((4, 8, 32), 0x21);
    names(
        o.plain(Inputs {
            q: Queries::E2m1 {
                packed: bad_q.view(),
                scale: o.qs.view(),
            },
            ..o.inputs()
        }),
        "q",
        "[4, 8, 32]",
    );
    let q12 = Array3::<u8>::from_elem((7, 12, 32), 0x21);
    names(
        o.plain(Inputs {
            q: Queries::E2m1 {
                packed: q12.view(),
                scale: o.qs.view(),
            },
            ..o.inputs()
        }),
        "heads",
        "12",
    );
    let q128 = Array3::<u8>::from_elem((7, 128, 32), 0x21);
    names(
        o.plain(Inputs {
            q: Queries::E2m1 {
                packed: q128.view(),
                scale: o.qs.view(),
            },
            ..o.inputs()
        }),
        "heads",
        "128",
    );
    let d96 = Array3::<u8>::from_elem((7, 8, 96), 0x38);
    names(
        o.plain(Inputs {
            q: Queries::E4m3(d96.view()),
            ..o.inputs()
        }),
        "dim",
        "96",
    );
    let short_scale = Array3::<u8>::from_elem((7, 8, 1), 127);
    names(
        o.plain(Inputs {
            q: Queries::E2m1 {
                packed: o.q4.view(),
                scale: short_scale.view(),
            },
            ..o.inputs()
        }),
        "q_scale",
        "[7, 8, 1]",
    );
    let k_short = Array2::<u8>::from_elem((8, 64), 0x30);
    names(
        o.plain(Inputs {
            k: Keys::E4m3 {
                codes: k_short.view(),
                scale: o.kscale.view(),
            },
            ..o.inputs()
        }),
        "k",
        "[8, 64]",
    );
    let w_bad = Array2::<f32>::zeros((7, 16));
    names(
        o.plain(Inputs {
            weights: w_bad.view(),
            ..o.inputs()
        }),
        "weights",
        "[7, 16]",
    );
}

#[test]
fn parameters() {
    let o = owned();
    names(
        o.problem(o.inputs(), Params::new(0), Role::Plain),
        "topk",
        "0",
    );
    names(
        o.problem(o.inputs(), Params::new(1 << 20), Role::Plain),
        "topk",
        "1048576",
    );
    names(
        o.problem(
            o.inputs(),
            Params {
                page_cols: Some(3),
                ..Params::new(4)
            },
            Role::Plain,
        ),
        "page_cols",
        "3",
    );
    // A page row past 65536 ids is refused, not allocated as T x page_cols (a dump found
    // by the dump_struct fuzz target asked for 63 GB of them); so is a published row of
    // more than 65536 blocks.
    for wide in [65537usize, 1 << 31] {
        names(
            o.problem(
                o.inputs(),
                Params {
                    num_blocks: wide,
                    ..Params::new(4)
                },
                Role::Source { tail: None },
            ),
            "num_blocks",
            &wide.to_string(),
        );
        names(
            o.problem(
                o.inputs(),
                Params {
                    page_cols: Some(wide),
                    ..Params::new(4)
                },
                Role::Plain,
            ),
            "page_cols",
            &wide.to_string(),
        );
    }
    names(
        o.problem(
            o.inputs(),
            Params {
                block_size: 0,
                ..Params::new(4)
            },
            Role::Plain,
        ),
        "block_size",
        "0",
    );
    names(
        o.problem(
            o.inputs(),
            Params {
                num_blocks: 0,
                ..Params::new(4)
            },
            Role::Plain,
        ),
        "num_blocks",
        "0",
    );
    names(
        o.problem(o.inputs(), Params::new(4), Role::Source { tail: Some(0) }),
        "tail",
        "0",
    );
    let p = Problem::new(&o.batch, o.inputs(), Params::new(4), Role::Plain).unwrap();
    names(run_cpu(&p, 0).map(|_| ()), "budget", "0");
}

#[test]
fn values() {
    let o = owned();
    let mut q8 = o.q8.clone();
    q8[[1, 2, 3]] = 0xFF;
    names(
        o.plain(Inputs {
            q: Queries::E4m3(q8.view()),
            ..o.inputs()
        }),
        "q[",
        "0xff",
    );
    let mut k8 = o.k8.clone();
    k8[[0, 5]] = 0x7F;
    names(
        o.plain(Inputs {
            k: Keys::E4m3 {
                codes: k8.view(),
                scale: o.kscale.view(),
            },
            ..o.inputs()
        }),
        "k[5]",
        "0x7f",
    );
    let mut qs = o.qs.clone();
    qs[[0, 0, 1]] = 255;
    names(
        o.plain(Inputs {
            q: Queries::E2m1 {
                packed: o.q4.view(),
                scale: qs.view(),
            },
            ..o.inputs()
        }),
        "q_scale[1]",
        "255",
    );
    let mut ks4 = o.ks4.clone();
    ks4[[2, 0]] = 255;
    names(
        o.plain(Inputs {
            k: Keys::E2m1 {
                packed: o.k4.view(),
                scale: ks4.view(),
            },
            ..o.inputs()
        }),
        "k_scale[4]",
        "255",
    );
    for bad in [f32::NAN, f32::INFINITY] {
        let mut w = o.w.clone();
        w[[3, 1]] = bad;
        names(
            o.plain(Inputs {
                weights: w.view(),
                ..o.inputs()
            }),
            "weights[25]",
            &bad.to_string(),
        );
    }
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let mut s = o.kscale.clone();
        s[2] = bad;
        names(
            o.plain(Inputs {
                k: Keys::E4m3 {
                    codes: o.k8.view(),
                    scale: s.view(),
                },
                ..o.inputs()
            }),
            "k_scale[2]",
            &bad.to_string(),
        );
    }
    let mut slots = o.slots.clone();
    slots[4] = -3;
    names(
        o.plain(Inputs {
            k_slots: Some(slots.view()),
            ..o.inputs()
        }),
        "k_slots[4]",
        "-3",
    );
    let short = Array1::<i32>::zeros(3);
    names(
        o.plain(Inputs {
            k_slots: Some(short.view()),
            ..o.inputs()
        }),
        "k_slots",
        "[3]",
    );
}

#[test]
fn consumer_candidates_must_match() {
    let o = owned();
    let published = o.published();
    let params = Owned::block_params();
    o.problem(o.inputs(), params, Role::Consumer(&published))
        .unwrap();
    // Width.
    names(
        o.problem(
            o.inputs(),
            Params {
                num_blocks: 3,
                ..params
            },
            Role::Consumer(&published),
        ),
        "width",
        "2",
    );
    // Block size.
    names(
        o.problem(
            o.inputs(),
            Params {
                block_size: 4,
                ..params
            },
            Role::Consumer(&published),
        ),
        "block_size",
        "2",
    );
    // Rows: one fewer.
    let mut fewer = published.clone();
    fewer.rows.pop();
    names(
        o.problem(o.inputs(), params, Role::Consumer(&fewer)),
        "rows",
        "7",
    );
    // A position that differs.
    let mut moved: Published = published.clone();
    moved.rows[1].1 += 1;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&moved)),
        "row[1].position",
        "4",
    );
    // A request that differs.
    let mut other = published.clone();
    other.rows[0].0 = 1;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&other)),
        "row[0].request",
        "1",
    );
    // A request whose key count differs.
    let mut longer = published.clone();
    longer.seq_lens[0] = 60;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&longer)),
        "row[0].keys",
        "60",
    );
    // Ratio.
    let mut r2 = published.clone();
    r2.ratio = 2;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&r2)),
        "ratio",
        "2",
    );
    // A block id outside the row's visible blocks, and ids out of order.
    let mut far = published.clone();
    far.blocks[[0, 1]] = 50;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&far)),
        "blocks[0, 1]",
        "50",
    );
    let mut unsorted = published.clone();
    unsorted.blocks[[6, 0]] = 1;
    unsorted.blocks[[6, 1]] = 0;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&unsorted)),
        "blocks[6, 1]",
        "0",
    );
    let mut gap = published.clone();
    gap.blocks[[6, 0]] = -1;
    gap.blocks[[6, 1]] = 1;
    names(
        o.problem(o.inputs(), params, Role::Consumer(&gap)),
        "blocks[6, 1]",
        "1",
    );
}

#[test]
fn sizes_that_overflow() {
    // Products that overflow usize are errors, not panics.
    let e = Batch::contiguous(&[usize::MAX / 2, usize::MAX / 2, 10], &[0, 0, 0], 1).unwrap_err();
    assert!(matches!(e, Error::Overflow { .. }), "{e}");
    let big = Batch::contiguous(&[1 << 31], &[(1 << 31) - 1], 1).unwrap();
    let o = owned();
    let q = Array3::<u8>::from_elem((1, 8, 32), 0x21);
    let qs = Array3::<u8>::from_elem((1, 8, 1), 127);
    let w = Array2::<f32>::zeros((1, 8));
    let e = Problem::new(
        &big,
        Inputs {
            q: Queries::E2m1 {
                packed: q.view(),
                scale: qs.view(),
            },
            weights: w.view(),
            k_slots: None,
            ..o.inputs()
        },
        Params::new(4),
        Role::Plain,
    )
    .unwrap_err();
    assert!(e.to_string().contains("keys L"), "{e}");
}

#[test]
fn driver_entry_points_check_what_they_are_given() {
    use dsa_indexer::indexer::{Backend, CpuBackend};
    use dsa_indexer::reference::Output;
    let o = owned();
    let p = Problem::new(&o.batch, o.inputs(), Params::new(4), Role::Plain).unwrap();
    let mut b = CpuBackend::new();
    let plan = dsa_indexer::indexer::plan_for(&b, &p, 256).unwrap();
    let mut out = Output::alloc(&p);
    // A tile before begin(), a tile index past the plan, outputs of the wrong shape.
    assert!(b
        .tile(&p, &plan, 0, &mut out)
        .unwrap_err()
        .to_string()
        .contains("begin"));
    b.begin(&p, &plan).unwrap();
    names(
        b.tile(&p, &plan, plan.tiles.len(), &mut out),
        "tile",
        &plan.tiles.len().to_string(),
    );
    let mut wrong = Output {
        raw: Array2::zeros((7, 5)),
        ..Output::alloc(&p)
    };
    names(b.tile(&p, &plan, 0, &mut wrong), "raw", "[7, 5]");
    let mut column_major = Output {
        page: Array2::zeros((64, 7)).reversed_axes(),
        ..Output::alloc(&p)
    };
    names(
        b.tile(&p, &plan, 0, &mut column_major),
        "page (standard layout)",
        "[7, 64]",
    );
    b.tile(&p, &plan, 0, &mut out).unwrap();
    // Consumer block ids in column-major layout are refused rather than misread.
    let mut published = o.published();
    published.blocks = published
        .blocks
        .t()
        .as_standard_layout()
        .reversed_axes()
        .to_owned();
    assert!(!published.blocks.is_standard_layout());
    names(
        o.problem(
            o.inputs(),
            Owned::block_params(),
            Role::Consumer(&published),
        ),
        "layout",
        "row-major",
    );
}

/// The error is a shape error on `field` with shape `got` where `expected` was due,
/// and its message names the field and the shape.
fn shape_error(r: Result<(), Error>, field: &str, got: &[usize], expected: &[usize]) {
    let e = r.expect_err("expected a shape error");
    assert_eq!(
        e,
        Error::Shape {
            field: field.into(),
            got: got.to_vec(),
            expected: expected.to_vec(),
        }
    );
    let m = e.to_string();
    assert!(m.starts_with(&format!("{field}: shape {got:?}")), "{m}");
}

/// fp4 keys: `k_scale` is `[L, D/32]` (here `[9, 2]`); too narrow, too wide, too short.
#[test]
fn fp4_key_scale_of_the_wrong_shape() {
    let o = owned();
    for bad in [[9, 1], [9, 4], [8, 2], [10, 2]] {
        let ks = Array2::<u8>::from_elem((bad[0], bad[1]), 127);
        shape_error(
            o.plain(Inputs {
                k: Keys::E2m1 {
                    packed: o.k4.view(),
                    scale: ks.view(),
                },
                ..o.inputs()
            }),
            "k_scale",
            &bad,
            &[9, 2],
        );
    }
}

/// `D` comes from the queries; keys of another `D` are a shape error on `k`, in each
/// key format and either way round.
#[test]
fn query_and_key_dims_must_agree() {
    let o = owned();
    // Queries D = 64 (E2M1 and E4M3), E4M3 keys of D = 32.
    let k32 = Array2::<u8>::from_elem((9, 32), 0x30);
    let e4m3_keys = Keys::E4m3 {
        codes: k32.view(),
        scale: o.kscale.view(),
    };
    shape_error(
        o.plain(Inputs {
            k: e4m3_keys,
            ..o.inputs()
        }),
        "k",
        &[9, 32],
        &[9, 64],
    );
    shape_error(
        o.plain(Inputs {
            q: Queries::E4m3(o.q8.view()),
            k: e4m3_keys,
            ..o.inputs()
        }),
        "k",
        &[9, 32],
        &[9, 64],
    );
    // E2M1 keys of D = 32 (packed [9, 16], scales [9, 1]).
    let k4_32 = Array2::<u8>::from_elem((9, 16), 0x12);
    let ks4_32 = Array2::<u8>::from_elem((9, 1), 126);
    shape_error(
        o.plain(Inputs {
            k: Keys::E2m1 {
                packed: k4_32.view(),
                scale: ks4_32.view(),
            },
            ..o.inputs()
        }),
        "k",
        &[9, 16],
        &[9, 32],
    );
    // Queries D = 32 against the D = 64 keys of both formats.
    let q32 = Array3::<u8>::from_elem((7, 8, 32), 0x38);
    shape_error(
        o.plain(Inputs {
            q: Queries::E4m3(q32.view()),
            ..o.inputs()
        }),
        "k",
        &[9, 64],
        &[9, 32],
    );
    shape_error(
        o.plain(Inputs {
            q: Queries::E4m3(q32.view()),
            k: Keys::E2m1 {
                packed: o.k4.view(),
                scale: o.ks4.view(),
            },
            ..o.inputs()
        }),
        "k",
        &[9, 32],
        &[9, 16],
    );
}

/// `H = 4` is below SPEC 4's 8..=64, in both query formats, with weights of the
/// matching `[T, 4]` shape (so only `heads` is wrong).
#[test]
fn four_heads_are_out_of_range() {
    let o = owned();
    let q8 = Array3::<u8>::from_elem((7, 4, 64), 0x38);
    let q4 = Array3::<u8>::from_elem((7, 4, 32), 0x21);
    let qs = Array3::<u8>::from_elem((7, 4, 2), 127);
    let w = Array2::<f32>::from_elem((7, 4), 0.25);
    for q in [
        Queries::E4m3(q8.view()),
        Queries::E2m1 {
            packed: q4.view(),
            scale: qs.view(),
        },
    ] {
        let e = o
            .plain(Inputs {
                q,
                weights: w.view(),
                ..o.inputs()
            })
            .unwrap_err();
        assert!(
            matches!(&e, Error::OutOfRange { field, value, .. } if field == "heads" && value == "4"),
            "{e:?}"
        );
        assert!(e.to_string().starts_with("heads = 4: "), "{e}");
    }
}

/// A `-inf` weight on the host path (`Problem::new`) is a non-finite weight, named by
/// its flat index, in every format pair.
#[test]
fn negative_infinite_weight_is_an_error_on_the_host_path() {
    let o = owned();
    let mut w = o.w.clone();
    w[[3, 1]] = f32::NEG_INFINITY;
    let e4m3_keys = Keys::E4m3 {
        codes: o.k8.view(),
        scale: o.kscale.view(),
    };
    let e2m1_keys = Keys::E2m1 {
        packed: o.k4.view(),
        scale: o.ks4.view(),
    };
    for q in [Queries::E4m3(o.q8.view()), o.inputs().q] {
        for k in [e4m3_keys, e2m1_keys] {
            let e = o
                .plain(Inputs {
                    q,
                    k,
                    weights: w.view(),
                    ..o.inputs()
                })
                .unwrap_err();
            assert_eq!(
                e,
                Error::BadFloat {
                    field: "weights".into(),
                    index: 25,
                    value: f32::NEG_INFINITY,
                    expected: "finite",
                }
            );
            assert_eq!(e.to_string(), "weights[25] = -inf: finite");
        }
    }
}

/// `T * H * D` overflows usize only when `T >= 2^51` (`H * D <= 2^13`). Rows are
/// materialised, so a batch of that many rows is refused as an overflow of `rows T`
/// before any tensor is sized, contiguous or split over requests. The output sizes a
/// caller's parameters set are checked too: `page_cols` and `NB` past 65536 are refused
/// by name, so `T * page_cols` and (for a source) `T * NB` cannot overflow.
#[test]
fn sizes_that_overflow_with_the_row_count() {
    let t = usize::MAX / (64 * 128) + 1;
    assert!(t.checked_mul(64 * 128).is_none());
    let rows_t = Error::Overflow {
        field: "rows T".into(),
    };
    for (seq, q0) in [(vec![t], vec![0]), (vec![t / 2 + 1, t / 2], vec![0, 0])] {
        let e = Batch::contiguous(&seq, &q0, 1).unwrap_err();
        assert_eq!(e, rows_t, "{seq:?}");
        assert_eq!(e.to_string(), "rows T: size overflows usize");
    }
    let o = owned();
    let e = o
        .problem(
            o.inputs(),
            Params {
                page_cols: Some(usize::MAX / 4),
                ..Params::new(4)
            },
            Role::Plain,
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("page_cols = {}: page_cols <= 65536", usize::MAX / 4)
    );
    let e = o
        .problem(
            o.inputs(),
            Params {
                num_blocks: usize::MAX / 4,
                ..Params::new(4)
            },
            Role::Source { tail: None },
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("num_blocks = {}: num_blocks <= 65536", usize::MAX / 4)
    );
}

/// SPEC 5: without `page_cols`, `page` is `K` rounded up to a multiple of 64 wide:
/// 65 becomes 128. Its columns past the selected keys are `-1`.
#[test]
fn page_cols_default_rounds_topk_up_to_a_multiple_of_64() {
    let o = owned();
    for (k, want) in [
        (1, 64),
        (63, 64),
        (64, 64),
        (65, 128),
        (128, 128),
        (129, 192),
    ] {
        let p = Problem::new(&o.batch, o.inputs(), Params::new(k), Role::Plain).unwrap();
        assert_eq!(p.page_cols, want, "K = {k}");
    }
    let p = Problem::new(&o.batch, o.inputs(), Params::new(65), Role::Plain).unwrap();
    let (out, _) = run_cpu(&p, 1 << 20).unwrap();
    assert_eq!(out.raw.dim(), (7, 65));
    assert_eq!(out.page.dim(), (7, 128));
    // Every row has n <= 6 < K keys: all are selected, in order.
    for (i, row) in o.batch.rows().iter().enumerate() {
        for c in 0..128 {
            let want = if c < row.n {
                100 + (row.ks + c) as i32
            } else {
                -1
            };
            assert_eq!(out.page[[i, c]], want, "page[{i}, {c}]");
        }
    }
}
