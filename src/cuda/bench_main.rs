//! `dsa-cuda-bench [WORKLOAD ...] [--reps N]`: run issue 7's workloads on GPU 0 and print
//! one JSON line each (a stand-in until `dsa-indexer bench --device cuda` calls
//! [`dsa_indexer::cuda::bench::run_workload`]).

use dsa_indexer::cuda::{bench, CudaBackend};

fn main() {
    let mut names = Vec::new();
    let mut reps = 10usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--reps" {
            reps = args.next().and_then(|v| v.parse().ok()).unwrap_or(reps);
        } else {
            names.push(a);
        }
    }
    if names.is_empty() {
        names = bench::WORKLOADS
            .iter()
            .map(|w| w.name.to_string())
            .collect();
    }
    let mut b = match CudaBackend::new() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let mut failed = false;
    for n in names {
        match bench::workload(&n).and_then(|w| bench::run_workload(&mut b, &w, reps)) {
            Ok(r) => println!("{}", r.to_json()),
            Err(e) => {
                eprintln!("{n}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
