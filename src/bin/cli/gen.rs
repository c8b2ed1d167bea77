//! `gen`: a synthetic dump, random inputs through the crate's quantizers and the
//! reference's (or the engine's) outputs as its expected tensors.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use dsa_indexer::verdict::human_bytes;

use crate::errors::{CliError, Result};
use crate::{workload, ShapeArgs};

#[derive(Args)]
pub struct GenArgs {
    /// Output file (.safetensors).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Write `expected_logits` (sum n floats): auto = when at most 16M values.
    #[arg(long, value_enum, default_value_t = LogitsArg::Auto)]
    logits: LogitsArg,
    /// Who computes the expected tensors: the literal reference (`reference::run`,
    /// slow), the fast engine through the chunked driver (bitwise the same, held so by
    /// the tests), or auto = the reference up to 1M (row, key) pairs.
    #[arg(long, value_enum, default_value_t = ExpectedArg::Auto)]
    expected: ExpectedArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ExpectedArg {
    Auto,
    Reference,
    Engine,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogitsArg {
    Auto,
    Yes,
    No,
}

/// `dsa-indexer gen`.
pub fn cmd_gen(a: &GenArgs) -> Result<i32> {
    let shape = a.shape.shape()?;
    let t0 = Instant::now();
    let mut dump = workload::synth(&shape, a.shape.seed)?;
    let batch = dump.batch()?;
    let published = dump.published_input(&batch);
    let by_reference = match a.expected {
        ExpectedArg::Reference => true,
        ExpectedArg::Engine => false,
        ExpectedArg::Auto => batch.valid_pairs() <= 1 << 20,
    };
    let (out, logits) = {
        let p = dump.problem(&batch, published.as_ref())?;
        let want = match a.logits {
            LogitsArg::Yes => true,
            LogitsArg::No => false,
            LogitsArg::Auto => batch.valid_pairs() <= 16 << 20,
        };
        if by_reference {
            let out = dsa_indexer::reference::run(&p);
            (out, want.then(|| dsa_indexer::reference::logits(&p)))
        } else {
            let (out, _) = dsa_indexer::indexer::run_cpu(&p, 256 << 20)?;
            (out, want.then(|| parallel_logits(&p)))
        }
    };
    workload::set_expected(&mut dump, &batch, &out, logits);
    let bytes = dump.to_bytes()?;
    std::fs::write(&a.out, &bytes)
        .map_err(|e| CliError::environment(format!("{}: {e}", a.out.display())))?;
    println!(
        "wrote {}: preset {} (seed {}), {} rows, {} keys, H={} D={} K={}, {} x {}, {}, {}, expected tensors from the {} in {:.2} s",
        a.out.display(),
        a.shape.preset,
        a.shape.seed,
        batch.num_rows(),
        batch.num_keys(),
        shape.heads,
        shape.dim,
        shape.topk,
        shape.q_format,
        shape.k_format,
        human_bytes(bytes.len() as u128),
        if dump.expected.logits.is_some() {
            "with expected_logits"
        } else {
            "without expected_logits"
        },
        if by_reference {
            "reference"
        } else {
            "engine"
        },
        t0.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// All visible logits, rows concatenated, from the fast engine in parallel.
fn parallel_logits(p: &dsa_indexer::problem::Problem) -> Vec<f32> {
    use rayon::prelude::*;
    let rows = p.batch.rows();
    let mut out = vec![0f32; p.batch.valid_pairs()];
    let g = dsa_indexer::cpu::ROW_GROUP;
    let mut chunks: Vec<(usize, &mut [f32])> = Vec::new();
    let mut rest: &mut [f32] = &mut out;
    for start in (0..rows.len()).step_by(g) {
        let len: usize = rows[start..(start + g).min(rows.len())]
            .iter()
            .map(|r| r.n)
            .sum();
        let (a, b) = std::mem::take(&mut rest).split_at_mut(len);
        chunks.push((start, a));
        rest = b;
    }
    chunks.into_par_iter().for_each_init(
        || dsa_indexer::cpu::Engine::new(p),
        |e, (start, buf)| {
            let idx: Vec<usize> = (start..(start + g).min(rows.len())).collect();
            let mut outs: Vec<&mut [f32]> = Vec::new();
            let mut rest = buf;
            for &i in &idx {
                let (a, b) = rest.split_at_mut(rows[i].n);
                outs.push(a);
                rest = b;
            }
            e.rows(p, &idx, &mut outs);
        },
    );
    out
}
