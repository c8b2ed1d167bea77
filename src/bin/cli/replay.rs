//! `replay`: run a dump (SPEC 9) through the chunked driver and print the library's
//! verdict ([`dsa_indexer::verdict`]) as text or JSON.

use std::io::IsTerminal;
use std::time::Instant;

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::Dump;
use dsa_indexer::indexer::{self, Backend, TileEvent};
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::verdict::{self, Layer, ReplayReport, RowReport, Seconds};

use crate::errors::{CliError, Result};
use crate::Device;

/// Options of `replay`.
pub struct Opts {
    pub file: std::path::PathBuf,
    pub rows: Option<(usize, usize)>,
    pub request: Option<usize>,
    pub show_row: Option<usize>,
    pub device: Device,
    pub budget: Option<usize>,
    pub json: bool,
    pub max_show: usize,
    pub verbose: bool,
    pub tolerance: verdict::Tolerance,
}

/// Rows of a dump kept by `--rows` / `--request`, in original numbering.
fn select_rows(batch: &Batch, o: &Opts) -> Result<Vec<usize>> {
    let t = batch.num_rows();
    if let Some((a, b)) = o.rows {
        if a > b || b > t {
            bail!("--rows {a}..{b}: expected a range inside 0..{t}");
        }
    }
    if let Some(r) = o.request {
        if r >= batch.requests().len() {
            bail!(
                "--request {r}: the dump has {} requests",
                batch.requests().len()
            );
        }
    }
    Ok(dsa_indexer::dump::kept_rows(batch, o.rows, o.request))
}

/// `replay FILE`. Returns the exit code: 0 identical, equal up to ties or equal within
/// tolerance, 1 different.
pub fn replay(o: &Opts) -> Result<i32> {
    let t0 = Instant::now();
    let name = o.file.display().to_string();
    let bytes =
        std::fs::read(&o.file).map_err(|e| CliError::environment(format!("{name}: {e}")))?;
    let with_name = |e: dsa_indexer::Error| CliError::lib(&name, e);
    let full = Dump::from_bytes(&bytes).map_err(with_name)?;
    drop(bytes);
    let full_batch = full.batch().map_err(with_name)?;
    let sel = select_rows(&full_batch, o)?;
    let partial = sel.len() != full_batch.num_rows();
    let (dump, batch) = if partial {
        let d = full.select_rows(&full_batch, &sel)?;
        let b = d.batch().map_err(with_name)?;
        (d, b)
    } else {
        (full, full_batch)
    };
    let published = dump.published_input(&batch);
    let p = dump
        .problem(&batch, published.as_ref())
        .map_err(with_name)?;
    let e = &dump.expected;
    verdict::check_shapes(&p, e, dump.engine_logits.as_ref()).map_err(with_name)?;
    let t_parse = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let budget = o
        .budget
        .unwrap_or_else(|| dsa_indexer::dump::replay_budget(&batch));
    let out = run_driver(&p, o.device, budget, true)?;
    let t_run = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let opts = verdict::Options {
        row_numbers: Some(&sel),
        max_notes: o.max_show,
        full_ids: o.verbose,
        tolerance: o.tolerance,
    };
    let v = verdict::judge(&p, &out, e, dump.engine_logits.as_ref(), &opts).map_err(with_name)?;
    let report = ReplayReport {
        file: name,
        partial,
        layer: Layer::of(&p),
        device: o.device.name().into(),
        device_detail: o.device.describe(),
        budget,
        seconds: Seconds {
            parse: t_parse,
            run: t_run,
            diff: t2.elapsed().as_secs_f64(),
        },
        verdict: v,
    };
    if o.json {
        // Through a `Value`, whose object keys are ordered.
        let j = serde_json::to_value(&report).unwrap_or_default();
        println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
    } else {
        print!("{report}");
    }
    if let Some(orig) = o.show_row {
        let Some(i) = sel.iter().position(|&x| x == orig) else {
            bail!("--show-row {orig}: not among the replayed rows");
        };
        print!("{}", RowReport::new(&p, i, orig, &out, e)?);
    }
    Ok(report.exit_code())
}

/// Run `p` on `device`, tile by tile, with a progress bar on a terminal.
pub fn run_driver(p: &Problem, device: Device, budget: usize, progress: bool) -> Result<Output> {
    match device {
        Device::Cpu => {
            let mut b = indexer::CpuBackend::new();
            drive(&mut b, p, budget, progress)
        }
        Device::Cuda => crate::cuda_backend(|b| drive(b, p, budget, progress)),
    }
}

/// [`indexer::run_observed`] with a progress bar of its tiles on a terminal.
pub fn drive<B: Backend + ?Sized>(
    b: &mut B,
    p: &Problem,
    budget: usize,
    progress: bool,
) -> Result<Output> {
    let show = progress && std::io::stderr().is_terminal();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let res = indexer::run_observed(b, p, budget, |e| match e {
        TileEvent::Planned { tiles } if show => bar = Some(progress_bar(tiles)),
        TileEvent::Done { .. } => {
            if let Some(bar) = &bar {
                bar.inc(1);
            }
        }
        _ => {}
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(res?.0)
}

fn progress_bar(tiles: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(tiles as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} replay [{bar:40}] {pos}/{len} tiles, {elapsed_precise} (eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
