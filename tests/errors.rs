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
