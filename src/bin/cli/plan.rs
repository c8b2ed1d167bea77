//! `plan`: a layer's planned peak under a byte budget, term by term, next to the seed
//! engine's unbounded transient.

use clap::Args;
use dsa_indexer::batch::Batch;
use dsa_indexer::indexer::{RowFootprint, CPU_ROW_ALIGN};
use dsa_indexer::plan::{self, Plan, PlanParams, PlanRole};
use dsa_indexer::problem::Class;
use dsa_indexer::verdict::human_bytes;
use serde_json::json;

use crate::errors::{CliError, Result};
use crate::{parse_bytes, RoleArg};

#[derive(Args)]
pub struct PlanArgs {
    /// Query rows R (the last R positions of one request).
    #[arg(long, default_value_t = 16384)]
    rows: usize,
    /// Compressed keys of the request (its tokens are context * ratio).
    #[arg(long, default_value_t = 487_936)]
    context: usize,
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 128)]
    dim: usize,
    #[arg(long, default_value_t = 512)]
    topk: usize,
    #[arg(long, default_value_t = 1)]
    ratio: usize,
    #[arg(long, value_parser = parse_bytes, default_value = "2GiB")]
    budget: usize,
    /// Source layers: publish only the last `tail` rows.
    #[arg(long)]
    tail: Option<usize>,
    #[arg(long, value_enum, default_value_t = RoleArg::Plain)]
    role: RoleArg,
    #[arg(long, default_value_t = 8)]
    block_size: usize,
    #[arg(long, default_value_t = 2048)]
    num_blocks: usize,
    /// Format class of the operand buffers (exact = fp4 x fp4).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    exact: bool,
    /// Workers of the CPU footprint (default: this machine's threads).
    #[arg(long)]
    workers: Option<usize>,
    #[arg(long)]
    json: bool,
}

/// What `plan` prints beside the plan.
struct Layer<'a> {
    a: &'a PlanArgs,
    keys: usize,
    tokens: usize,
    role_name: String,
    terms: [(&'static str, usize); 6],
}

/// `dsa-indexer plan`.
pub fn cmd_plan(a: &PlanArgs) -> Result<i32> {
    if a.rows == 0 {
        bail!("rows = 0: expected at least one row");
    }
    if a.ratio == 0 {
        bail!("ratio = 0: expected ratio >= 1");
    }
    let seq = a
        .context
        .checked_mul(a.ratio)
        .ok_or_else(|| CliError::input("context * ratio overflows"))?;
    if a.rows > seq {
        bail!("rows = {}: more than the request's {seq} tokens", a.rows);
    }
    let batch = Batch::contiguous(&[seq], &[seq - a.rows], a.ratio)?;
    let role = match a.role {
        RoleArg::Plain if a.tail.is_some() => PlanRole::Source { tail: a.tail },
        RoleArg::Plain => PlanRole::Plain,
        RoleArg::Source => PlanRole::Source { tail: a.tail },
        RoleArg::Consumer => PlanRole::Consumer,
    };
    let params = PlanParams {
        heads: a.heads,
        dim: a.dim,
        topk: a.topk,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        role,
        budget: a.budget,
    };
    let class = if a.exact {
        Class::Exact
    } else {
        Class::Tolerance
    };
    // The CPU backend's footprint: rows padded to 4 floats, one engine per worker.
    let fp = RowFootprint {
        align: CPU_ROW_ALIGN,
        workers: a
            .workers
            .unwrap_or_else(|| rayon::current_num_threads().max(1)),
        worker_bytes: dsa_indexer::cpu::Engine::bytes(a.heads, a.dim, class),
    };
    let pl = plan::plan(&batch, &params, &fp)?;
    let pk = pl.peak;
    let role_name = match role {
        PlanRole::Plain => "plain".to_string(),
        PlanRole::Source { tail: Some(t) } => format!("source, tail {t}"),
        PlanRole::Source { tail: None } => "source".to_string(),
        PlanRole::Consumer => "consumer".to_string(),
    };
    let terms = [
        ("logits_tile", pk.logits_tile),
        ("block_scores", pk.block_scores),
        ("candidate_ids", pk.candidate_ids),
        ("topk_scratch", pk.topk_scratch),
        ("index_assembly", pk.index_assembly),
        ("operands", pk.operands),
    ];
    let l = Layer {
        a,
        keys: batch.num_keys(),
        tokens: seq,
        role_name,
        terms,
    };
    if a.json {
        print_json(&l, &pl);
    } else {
        print_text(&l, &pl);
    }
    Ok(0)
}

fn print_json(l: &Layer, pl: &Plan) {
    let a = l.a;
    let j = json!({
        "rows": a.rows, "keys": l.keys, "tokens": l.tokens,
        "heads": a.heads, "dim": a.dim, "topk": a.topk, "ratio": a.ratio,
        "role": l.role_name, "tail": a.tail, "budget_bytes": a.budget,
        "block_size": a.block_size, "num_blocks": a.num_blocks,
        "workers": pl.workers,
        "unbounded_bytes": pl.unbounded_bytes as u64,
        "planned_peak_bytes": pl.peak.total(),
        "terms": l.terms.iter().map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "tiles": pl.tiles.len(),
        "max_tile_rows": pl.max_tile_rows,
        "published_rows": pl.published_rows,
        "oversized_row": pl.has_oversized_row(),
    });
    println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
}

fn print_text(l: &Layer, pl: &Plan) {
    let a = l.a;
    println!(
        "plan: {} rows x {} keys (one request of {} tokens, ratio {}), H={} D={} K={}, {}, budget {}",
        a.rows,
        l.keys,
        l.tokens,
        a.ratio,
        a.heads,
        a.dim,
        a.topk,
        l.role_name,
        human_bytes(a.budget as u128)
    );
    println!(
        "  unbounded (seed engine: fp32 logits + bool mask + copy, 6 B per (row, key)): {:>12}  ({} B)",
        human_bytes(pl.unbounded_bytes),
        pl.unbounded_bytes
    );
    println!(
        "  planned peak ({} workers, CPU footprint):{:>38}  ({} B)",
        pl.workers,
        human_bytes(pl.peak.total() as u128),
        pl.peak.total()
    );
    for (n, v) in l.terms {
        println!("    {n:<16} {:>12}  ({v} B)", human_bytes(v as u128));
    }
    println!(
        "  tiles: {} (at most {} rows each){}; published rows: {}",
        pl.tiles.len(),
        pl.max_tile_rows,
        if pl.has_oversized_row() {
            ", one row alone exceeds the budget"
        } else {
            ""
        },
        pl.published_rows
    );
}
