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
    /// Decode (SPEC 10): each of `--requests` requests of `--context` keys has its
    /// `next_n` newest positions as rows (`--rows` is then ignored), and the plan adds the
    /// CUDA decode step's workspace.
    #[arg(long)]
    next_n: Option<usize>,
    /// Requests of a decode batch.
    #[arg(long, default_value_t = 1)]
    requests: usize,
    /// Tokens per page of the decode step's paged keys.
    #[arg(long, default_value_t = 64)]
    page_size: usize,
    /// SMs of the GPU the decode step's workspace is sized for (the H200 has 132).
    #[arg(long, default_value_t = 132)]
    sms: usize,
    #[arg(long)]
    json: bool,
}

/// What `plan` prints beside the plan.
struct Layer<'a> {
    a: &'a PlanArgs,
    rows: usize,
    keys: usize,
    tokens: usize,
    role_name: String,
    terms: [(&'static str, usize); 6],
    /// The CUDA decode step's workspace, term by term (decode plans, CUDA builds).
    decode: Option<Vec<(&'static str, usize)>>,
}

/// The workspace of the CUDA decode step (`Engine::decode_workspace_bytes`) for a
/// decode plan: `None` for prefill plans and in builds without the `cuda` feature.
#[cfg(feature = "cuda")]
fn decode_workspace(a: &PlanArgs, seq: usize) -> Result<Option<Vec<(&'static str, usize)>>> {
    use dsa_indexer::cuda::{decode_workspace_terms, DecodeShape};
    use dsa_indexer::problem::Format;
    let Some(next_n) = a.next_n else {
        return Ok(None);
    };
    if !a.page_size.is_power_of_two() || a.page_size > 256 {
        bail!(
            "page_size = {}: expected a power of two in 1..=256",
            a.page_size
        );
    }
    let f = if a.exact { Format::E2m1 } else { Format::E4m3 };
    let shape = DecodeShape {
        batch: a.requests,
        next_n,
        max_context: seq,
        heads: a.heads,
        dim: a.dim,
        q: f,
        k: f,
        topk: a.topk,
        page_cols: None,
        page_size: a.page_size,
        max_pages: (seq / a.ratio).div_ceil(a.page_size),
        ratio: a.ratio,
    };
    Ok(Some(decode_workspace_terms(&shape, a.sms.max(1)).to_vec()))
}

#[cfg(not(feature = "cuda"))]
fn decode_workspace(_: &PlanArgs, _: usize) -> Result<Option<Vec<(&'static str, usize)>>> {
    Ok(None)
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
    if a.next_n.is_none() && a.rows > seq {
        bail!("rows = {}: more than the request's {seq} tokens", a.rows);
    }
    let batch = match a.next_n {
        None => Batch::contiguous(&[seq], &[seq - a.rows], a.ratio)?,
        Some(n) => {
            if n == 0 || n > seq {
                bail!("next_n = {n}: expected 1 ..= the request's {seq} tokens");
            }
            if a.requests == 0 {
                bail!("requests = 0: expected at least one request");
            }
            Batch::contiguous(&vec![seq; a.requests], &vec![seq - n; a.requests], a.ratio)?
        }
    };
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
        logits_slots: 1,
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
        rows: batch.num_rows(),
        keys: batch.num_keys(),
        tokens: seq,
        role_name,
        terms,
        decode: decode_workspace(a, seq)?,
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
        "rows": l.rows, "keys": l.keys, "tokens": l.tokens,
        "requests": if a.next_n.is_some() { a.requests } else { 1 }, "next_n": a.next_n,
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
        "decode_workspace": l.decode.as_ref().map(|t| json!({
            "sms": a.sms,
            "total_bytes": t.iter().map(|x| x.1).sum::<usize>(),
            "terms": t.iter().map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        })),
    });
    println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
}

fn print_text(l: &Layer, pl: &Plan) {
    let a = l.a;
    let reqs = match a.next_n {
        Some(n) => format!(
            "{} requests of {} tokens, {n} rows each",
            a.requests, l.tokens
        ),
        None => format!("one request of {} tokens", l.tokens),
    };
    println!(
        "plan: {} rows x {} keys ({reqs}, ratio {}), H={} D={} K={}, {}, budget {}",
        l.rows,
        l.keys,
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
    if let Some(t) = &l.decode {
        let total: usize = t.iter().map(|x| x.1).sum();
        println!(
            "  CUDA decode step workspace ({} SMs, pages of {}):{:>27}  ({total} B)",
            a.sms,
            a.page_size,
            human_bytes(total as u128)
        );
        for (n, v) in t {
            println!("    {n:<18} {:>12}  ({v} B)", human_bytes(*v as u128));
        }
    }
}
