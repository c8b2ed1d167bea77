//! Small readable cases: a logits grid, a top-k table and a candidate mask drawn with
//! `#` and `.`, for one DeepSeek-V3.2-shaped and one V4.1-shaped problem. Stored in
//! the top-level `snapshots/`. Scores are printed to 4 significant digits, so the
//! last ulp cannot churn them (the golden tests hold the bits).

mod common;

use std::fmt::Write;

use common::strategies::{build, Shape};
use dsa_indexer::dump::RoleKind;
use dsa_indexer::problem::Format;
use dsa_indexer::reference;

fn render(s: &Shape) -> String {
    let d = build(s);
    let batch = d.batch().unwrap();
    let p = d.problem(&batch, None).unwrap();
    let flat = reference::logits(&p);
    let out = reference::run(&p);
    let mut txt = String::new();
    writeln!(
        txt,
        "H={} D={} K={} q={} k={} ratio={} role={} B={} NB={}",
        s.heads,
        s.dim,
        s.topk,
        s.q_format,
        s.k_format,
        s.ratio,
        p.role.name(),
        s.block_size,
        s.num_blocks
    )
    .unwrap();
    writeln!(txt, "\nlogits (row: request/position, n):").unwrap();
    let mut off = 0;
    for (i, r) in batch.rows().iter().enumerate() {
        let cells: Vec<String> = flat[off..off + r.n]
            .iter()
            .map(|x| format!("{x:>9.3e}"))
            .collect();
        writeln!(
            txt,
            "{i:>2} {}/{:<3} n={:<3} {}",
            r.request,
            r.position,
            r.n,
            cells.join(" ")
        )
        .unwrap();
        off += r.n;
    }
    writeln!(txt, "\ntop-k (raw | page):").unwrap();
    for i in 0..batch.num_rows() {
        let raw: Vec<String> = out.raw.row(i).iter().map(|x| format!("{x:>3}")).collect();
        let page: Vec<String> = out
            .page
            .row(i)
            .iter()
            .take(s.topk + 1)
            .map(|x| format!("{x:>3}"))
            .collect();
        writeln!(txt, "{i:>2} {} | {} ...", raw.join(" "), page.join(" ")).unwrap();
    }
    if let Some(pb) = &out.published {
        writeln!(
            txt,
            "\ncandidate mask (published rows; # = key in a kept block, visible or not):"
        )
        .unwrap();
        for k in 0..pb.rows.len() {
            let (b, pos) = pb.rows[k];
            let m: String = pb
                .dense_row(k)
                .iter()
                .map(|&x| if x { '#' } else { '.' })
                .collect();
            let ids: Vec<String> = pb.blocks.row(k).iter().map(|x| x.to_string()).collect();
            writeln!(txt, "{b}/{pos:<3} {m}  [{}]", ids.join(",")).unwrap();
        }
    }
    txt
}

fn snap(name: &str, s: &Shape) {
    insta::with_settings!({ snapshot_path => "../snapshots", prepend_module_to_snapshot => false }, {
        insta::assert_snapshot!(name, render(s));
    });
}

#[test]
fn v32_shaped() {
    snap(
        "v32_shaped",
        &Shape {
            heads: 64,
            dim: 128,
            q_format: Format::E4m3,
            k_format: Format::E4m3,
            seed: 32,
            ..Shape::fp4(vec![14], vec![9])
        },
    );
}

#[test]
fn v41_shaped_source() {
    snap(
        "v41_shaped_source",
        &Shape {
            ratio: 2,
            heads: 32,
            dim: 128,
            topk: 3,
            block_size: 2,
            num_blocks: 3,
            role: RoleKind::Source,
            tail: Some(3),
            seed: 41,
            ..Shape::fp4(vec![24, 9], vec![20, 6])
        },
    );
}
