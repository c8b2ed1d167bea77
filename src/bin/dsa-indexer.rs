//! `dsa-indexer`: run the indexer on a built-in workload, write synthetic dumps, replay
//! engine dumps against the CPU reference, plan memory, and benchmark.
//!
//! The bare command prints help; `dsa-indexer run` runs the default workload.
//!
//! Exit codes (`docs/cli.md`): 0 success (for `replay`: identical, equal up to ties or
//! equal within tolerance), 1 `replay` found a difference, 2 bad input (malformed dump, bad
//! option value), 3 the environment (no GPU or no `cuda` feature, a CUDA or NVRTC
//! failure, an I/O error).

#[macro_use]
#[path = "cli/errors.rs"]
mod errors;
#[path = "cli/bench.rs"]
mod bench;
#[path = "cli/gen.rs"]
mod gen;
#[path = "cli/logits.rs"]
mod logits;
#[path = "cli/plan.rs"]
mod plan;
#[path = "cli/replay.rs"]
mod replay;
#[path = "cli/workload.rs"]
mod workload;

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use dsa_indexer::dump::RoleKind;
use dsa_indexer::indexer::Backend;
use dsa_indexer::problem::Format;
use dsa_indexer::reference::Output;
use dsa_indexer::verdict::{class_name, Tolerance};
use serde_json::json;

use errors::Result;
use workload::Shape;

#[derive(Parser)]
#[command(
    name = "dsa-indexer",
    version,
    about = "The indexer of DeepSeek sparse attention under a memory budget: run, gen, replay, plan, bench, logits",
    after_help = "Exit codes: 0 success, 1 replay found a difference, 2 bad input, \
                  3 no GPU, a CUDA or NVRTC failure, or an I/O error (docs/cli.md)."
)]
struct Cli {
    /// Worker threads of the CPU engine (default: one per core, or RAYON_NUM_THREADS).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the indexer on a synthetic workload (no options: the built-in default, a
    /// V4.1-shaped batch) and print rows, keys, time and a checksum of the outputs.
    Run(RunArgs),
    /// Write a synthetic dump: random inputs through the crate's quantizers, and the
    /// reference's outputs as the expected tensors.
    Gen(gen::GenArgs),
    /// Replay a dump on the reference through the chunked driver and diff its expected
    /// outputs (exit 0 identical, equal up to ties or within tolerance, 1 different, 2 bad
    /// dump, 3 no file or device).
    Replay(ReplayArgs),
    /// Plan a layer under a byte budget: the seed engine's unbounded transient next to
    /// the planned peak, term by term.
    Plan(plan::PlanArgs),
    /// Benchmark the logits + top-k driver on a preset: median time and effective TFLOP/s;
    /// or, with `--device cuda WORKLOAD ...`, the named GPU workloads as JSON lines (`--json`).
    Bench(bench::BenchArgs),
    /// Compute a dump's logits on a device (`--device cuda --precision fast`: the fast
    /// mode) and write the dump with them as its `expected_logits`, to set one device's
    /// arithmetic beside another's on the same inputs.
    Logits(logits::LogitsArgs),
}

/// Where the indexer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The fast CPU engine (bitwise equal to the reference).
    Cpu,
    /// The CUDA backend (feature `cuda`).
    Cuda,
}

impl Device {
    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu => format!(
                "cpu ({}, {} threads)",
                dsa_indexer::cpu::Isa::detect().name(),
                rayon::current_num_threads()
            ),
            Device::Cuda => "cuda".into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Fmt {
    E4m3,
    E2m1,
}

impl From<Fmt> for Format {
    fn from(f: Fmt) -> Format {
        match f {
            Fmt::E4m3 => Format::E4m3,
            Fmt::E2m1 => Format::E2m1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Plain,
    Source,
    Consumer,
}

/// Workload shape: a preset, then overrides.
#[derive(Args, Clone)]
pub struct ShapeArgs {
    /// Named preset: default, v41-replay, v41-source-tail, v32, small.
    #[arg(long, default_value = "default")]
    pub preset: String,
    /// Random seed of the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Index heads H (power of two, 8..=64).
    #[arg(long)]
    heads: Option<usize>,
    /// Head dimension D (32, 64, 128).
    #[arg(long)]
    dim: Option<usize>,
    /// Keys selected per row K.
    #[arg(long)]
    topk: Option<usize>,
    /// Compression ratio r.
    #[arg(long)]
    ratio: Option<usize>,
    /// Query format.
    #[arg(long, value_enum)]
    q_format: Option<Fmt>,
    /// Key format.
    #[arg(long, value_enum)]
    k_format: Option<Fmt>,
    /// Layer role (a consumer's candidates come from a source over the same batch).
    #[arg(long, value_enum)]
    role: Option<RoleArg>,
    /// Source layers: publish only each request's last `tail` rows.
    #[arg(long)]
    tail: Option<usize>,
    /// Candidate block size B.
    #[arg(long)]
    block_size: Option<usize>,
    /// Candidate blocks kept NB.
    #[arg(long)]
    num_blocks: Option<usize>,
    /// Tokens per request after this step, comma separated (S_b).
    #[arg(long, value_delimiter = ',')]
    seq_lens: Option<Vec<usize>>,
    /// First query position of each request (q0_b), comma separated; default 0.
    #[arg(long, value_delimiter = ',')]
    query_starts: Option<Vec<usize>>,
    /// Decode rows: each request's `next_n` newest positions (q0_b = S_b - next_n;
    /// 1 plain, 2..4 speculative), recorded as the dump's `next_n`.
    #[arg(long, conflicts_with = "query_starts")]
    next_n: Option<usize>,
    /// Paged keys (SPEC 10): the keys in a page pool through a page table, pages in
    /// random order, garbage in the unused pages and slots.
    #[arg(long)]
    paged: bool,
    /// Tokens per page of `--paged` keys (a power of two in 1..=256).
    #[arg(long, default_value_t = 64, requires = "paged")]
    page_size: usize,
}

impl ShapeArgs {
    pub fn shape(&self) -> Result<Shape> {
        let mut s = Shape::preset(&self.preset)?;
        if let Some(v) = self.heads {
            s.heads = v;
        }
        if let Some(v) = self.dim {
            s.dim = v;
        }
        if let Some(v) = self.topk {
            s.topk = v;
        }
        if let Some(v) = self.ratio {
            s.ratio = v;
        }
        if let Some(v) = self.q_format {
            s.q_format = v.into();
        }
        if let Some(v) = self.k_format {
            s.k_format = v.into();
        }
        if let Some(v) = self.role {
            s.role = match v {
                RoleArg::Plain => RoleKind::Plain,
                RoleArg::Source => RoleKind::Source,
                RoleArg::Consumer => RoleKind::Consumer,
            };
        }
        if self.tail.is_some() {
            s.tail = self.tail;
        }
        if s.role != RoleKind::Source && self.tail.is_none() {
            s.tail = None;
        }
        if let Some(v) = self.block_size {
            s.block_size = v;
        }
        if let Some(v) = self.num_blocks {
            s.num_blocks = v;
        }
        if let Some(v) = &self.seq_lens {
            s.seq_lens = v.clone();
            s.query_starts = vec![0; v.len()];
        }
        if let Some(v) = &self.query_starts {
            s.query_starts = v.clone();
        }
        if let Some(n) = self.next_n {
            if n == 0 {
                bail!("next_n = 0: expected at least one row per request");
            }
            s.query_starts = s.seq_lens.iter().map(|&l| l.saturating_sub(n)).collect();
            s.next_n = Some(n);
        }
        if self.paged {
            s.page_size = Some(self.page_size);
        }
        if s.query_starts.len() != s.seq_lens.len() {
            bail!(
                "query_starts: {} values, expected one per request ({})",
                s.query_starts.len(),
                s.seq_lens.len()
            );
        }
        Ok(s)
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    shape: ShapeArgs,
    /// Byte budget of the logits tile (e.g. 2GiB, 512MiB, 1048576).
    #[arg(long, value_parser = parse_bytes, default_value = "2GiB")]
    budget: usize,
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ReplayArgs {
    /// The dump (safetensors, the golden schema).
    file: PathBuf,
    /// Replay only rows A..B (original numbering).
    #[arg(long, value_parser = parse_range)]
    rows: Option<(usize, usize)>,
    /// Replay only the rows of request B.
    #[arg(long)]
    request: Option<usize>,
    /// Print row I's scores and selections.
    #[arg(long)]
    show_row: Option<usize>,
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Byte budget of the logits tile (default: a 32nd of the dump's logits, between
    /// 16 MiB and 256 MiB, so that progress shows; outputs do not depend on it).
    #[arg(long, value_parser = parse_bytes)]
    budget: Option<usize>,
    /// Differing rows shown per tensor.
    #[arg(long, default_value_t = 5)]
    show: usize,
    /// Print index sets in full.
    #[arg(long)]
    verbose: bool,
    /// Tolerance of the selections: `auto` (twice each row's measured logit error with
    /// engine_logits; else exact ties for the exact class, 2^-13 M for the tolerance
    /// class), `0` (exact ties only) or `2^X` (X <= 0), in units of the row's M.
    #[arg(long, default_value = "auto", value_parser = parse_tolerance)]
    tolerance: Tolerance,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `auto`, `0`, `2^-13`.
fn parse_tolerance(s: &str) -> std::result::Result<Tolerance, String> {
    s.parse::<Tolerance>().map_err(|e| e.to_string())
}

/// `2GiB`, `512MiB`, `64KiB`, `1.5G`, or a plain byte count.
pub fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" | "kb" => 1024.0,
        "m" | "mib" | "mb" => 1024.0 * 1024.0,
        "g" | "gib" | "gb" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" | "tb" => 1024f64.powi(4),
        u => return Err(format!("{s:?}: unknown unit {u:?} (B, KiB, MiB, GiB, TiB)")),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a byte count such as 2GiB"))?;
    let b = v * mult;
    if !(b.is_finite() && b >= 0.0 && b < usize::MAX as f64) {
        return Err(format!("{s:?}: out of range"));
    }
    Ok(b as usize)
}

/// `A..B` or `A:B`.
fn parse_range(s: &str) -> std::result::Result<(usize, usize), String> {
    let (a, b) = s
        .split_once("..")
        .or_else(|| s.split_once(':'))
        .ok_or_else(|| format!("{s:?}: expected A..B"))?;
    let p = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("{s:?}: expected A..B with integers"))
    };
    Ok((p(a)?, p(b)?))
}

/// Run `f` on the CUDA backend, or say why there is none.
pub fn cuda_backend<T>(f: impl FnOnce(&mut dyn Backend) -> Result<T>) -> Result<T> {
    #[cfg(feature = "cuda")]
    {
        let mut b = dsa_indexer::cuda::CudaBackend::new()?;
        f(&mut b)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = f;
        Err(errors::CliError::environment(
            "--device cuda: built without the cuda feature (rebuild with `--features cuda`)",
        ))
    }
}

/// FNV-1a (64-bit) over the outputs' little-endian bytes: `raw`, `page`, then the
/// published blocks of a source.
pub fn checksum(out: &Output) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: i32| {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    out.raw.iter().for_each(|&v| eat(v));
    out.page.iter().for_each(|&v| eat(v));
    if let Some(pb) = &out.published {
        pb.blocks.iter().for_each(|&v| eat(v));
    }
    h
}

fn cmd_run(a: &RunArgs) -> Result<i32> {
    let shape = a.shape.shape()?;
    let tg = Instant::now();
    let dump = workload::synth(&shape, a.shape.seed)?;
    let t_gen = tg.elapsed().as_secs_f64();
    let batch = dump.batch()?;
    let published = dump.published_input(&batch);
    let p = dump.problem(&batch, published.as_ref())?;
    let t0 = Instant::now();
    let out = replay::run_driver(&p, a.device, a.budget, false)?;
    let secs = t0.elapsed().as_secs_f64();
    let sum = checksum(&out);
    let pairs = batch.valid_pairs();
    let tflops = 2.0 * pairs as f64 * (p.heads * p.dim) as f64 / secs / 1e12;
    if a.json {
        let j = json!({
            "preset": a.shape.preset, "seed": a.shape.seed,
            "rows": batch.num_rows(), "keys": batch.num_keys(), "requests": batch.requests().len(),
            "valid_pairs": pairs,
            "heads": p.heads, "dim": p.dim, "topk": p.topk, "ratio": batch.ratio(),
            "q_format": p.q_format().to_string(), "k_format": p.k_format().to_string(),
            "class": class_name(p.class()), "role": p.role.name(),
            "device": a.device.name(), "budget_bytes": a.budget,
            "seconds": secs, "gen_seconds": t_gen, "tflops": tflops,
            "checksum": format!("{sum:016x}"),
        });
        println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
    } else {
        println!(
            "dsa-indexer run: preset {} (seed {}), H={} D={} K={} ratio {}, {} x {} ({} class), {}",
            a.shape.preset,
            a.shape.seed,
            p.heads,
            p.dim,
            p.topk,
            batch.ratio(),
            p.q_format(),
            p.k_format(),
            class_name(p.class()),
            p.role.name()
        );
        println!(
            "  rows      {} ({} requests, seq_lens {:?}, query_starts {:?})",
            batch.num_rows(),
            batch.requests().len(),
            shape.seq_lens,
            shape.query_starts
        );
        println!(
            "  keys      {} ({} visible (row, key) pairs)",
            batch.num_keys(),
            pairs
        );
        println!(
            "  time      {:.3} s on {} ({:.3} effective TFLOP/s; inputs generated in {:.2} s)",
            secs,
            a.device.describe(),
            tflops,
            t_gen
        );
        println!("  checksum  {sum:016x}  (FNV-1a 64 of raw, page, published)");
    }
    Ok(0)
}

fn main() {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        if n == 0 {
            eprintln!("error: --threads 0: expected at least one thread");
            std::process::exit(errors::BAD_INPUT);
        }
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
        {
            eprintln!("error: --threads {n}: {e}");
            std::process::exit(errors::BAD_INPUT);
        }
    }
    let Some(cmd) = &cli.cmd else {
        // The bare command: what there is to run.
        let _ = Cli::command().print_help();
        std::process::exit(0);
    };
    let res = match cmd {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Gen(a) => gen::cmd_gen(a),
        Cmd::Replay(a) => replay::replay(&replay::Opts {
            file: a.file.clone(),
            rows: a.rows,
            request: a.request,
            show_row: a.show_row,
            device: a.device,
            budget: a.budget,
            json: a.json,
            max_show: a.show,
            verbose: a.verbose,
            tolerance: a.tolerance,
        }),
        Cmd::Plan(a) => plan::cmd_plan(a),
        Cmd::Bench(a) => bench::cmd_bench(a),
        Cmd::Logits(a) => logits::cmd_logits(a),
    };
    match res {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", e.msg);
            std::process::exit(e.code);
        }
    }
}
