//! `logits`: a dump's logits computed on a device, written back as the dump's
//! `expected_logits`, so that a device's arithmetic can be set beside another's on the
//! same inputs (`benches/peers.py --ours`: the fast precision beside DeepGEMM's).

use std::path::PathBuf;

use clap::Args;
use dsa_indexer::dump::Dump;
use serde_json::json;

use crate::errors::{CliError, Result};
use crate::{parse_bytes, Device};

#[derive(Args)]
pub struct LogitsArgs {
    /// The dump (SPEC 9).
    file: PathBuf,
    /// Where to write the dump with the device's logits as `expected_logits` (sum n
    /// floats, row after row).
    #[arg(long)]
    out: PathBuf,
    /// The fast CPU engine (bitwise the reference) or the CUDA backend.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// The CUDA tolerance class's arithmetic: `full` or `fast` (`bench --precision`).
    #[arg(long, default_value = "full")]
    precision: String,
    /// Byte budget of the CUDA backend's logits tile.
    #[arg(long, value_parser = parse_bytes, default_value = "2GiB")]
    budget: usize,
}

/// `dsa-indexer logits FILE --out OUT`: prints one JSON line (where, how many logits).
pub fn cmd_logits(a: &LogitsArgs) -> Result<i32> {
    let name = a.file.display().to_string();
    let bytes =
        std::fs::read(&a.file).map_err(|e| CliError::environment(format!("{name}: {e}")))?;
    let with_name = |e: dsa_indexer::Error| CliError::lib(&name, e);
    let mut dump = Dump::from_bytes(&bytes).map_err(with_name)?;
    drop(bytes);
    let batch = dump.batch().map_err(with_name)?;
    let logits = {
        let published = dump.published_input(&batch);
        let p = dump
            .problem(&batch, published.as_ref())
            .map_err(with_name)?;
        match a.device {
            Device::Cpu => {
                if a.precision != "full" {
                    bail!(
                        "--precision {}: the precision is a mode of --device cuda",
                        a.precision
                    );
                }
                dsa_indexer::cpu::engine_logits(&p, dsa_indexer::cpu::Isa::detect())
            }
            Device::Cuda => cuda_logits(&p, &a.precision, a.budget)?,
        }
    };
    let n = logits.len();
    dump.expected.logits = Some(logits);
    let out = dump.to_bytes()?;
    std::fs::write(&a.out, &out)
        .map_err(|e| CliError::environment(format!("{}: {e}", a.out.display())))?;
    let j = json!({
        "file": name, "out": a.out.display().to_string(), "device": a.device.name(),
        "precision": a.precision, "logits": n,
    });
    println!("{j}");
    Ok(0)
}

#[cfg(feature = "cuda")]
fn cuda_logits(
    p: &dsa_indexer::problem::Problem,
    precision: &str,
    budget: usize,
) -> Result<Vec<f32>> {
    let precision = dsa_indexer::cuda::Precision::parse(precision)?;
    let mut b = dsa_indexer::cuda::CudaBackend::new()?.with_precision(precision);
    Ok(b.logits(p, budget)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_logits(_: &dsa_indexer::problem::Problem, _: &str, _: usize) -> Result<Vec<f32>> {
    Err(CliError::environment(
        "--device cuda: built without the cuda feature (rebuild with `--features cuda`)",
    ))
}
