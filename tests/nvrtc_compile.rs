//! Every kernel variant compiles for sm_90a with NVRTC (no GPU needed). CI installs
//! NVRTC 13.0.88 and runs this with `DSA_REQUIRE_NVRTC=1`, under which a missing
//! libnvrtc fails instead of skipping.
//!
//! With `DSA_PTX_DIR=dir` it writes each module's PTX there: `VARIANT.ptx` for the top-k
//! and validation modules, `VARIANT.KERNEL.ptx` for each logits kernel that can serve the
//! variant (`benches/ptx_equiv.py` compares two such folders kernel by kernel), the
//! modules of production ([`Hooks::default()`]). Every module a single test hook changes
//! (the forced fallbacks) also compiles under it; those are checked, not written.
#![cfg(feature = "cuda")]

use dsa_indexer::cuda::kernels::{self, compile, compile_logits, nvrtc_present, Variant};
use dsa_indexer::cuda::Hooks;

/// Checks one module's PTX: sm_90a, and every entry the backend loads from it by name;
/// writes it to `$DSA_PTX_DIR` when `write`.
fn check(name: &str, src: &str, entries: &[&str], write: bool) {
    assert!(src.contains(".target sm_90a"), "{name}: not sm_90a PTX");
    for e in entries {
        assert!(
            src.contains(&format!(".entry {e}(")),
            "{name}: no entry {e}"
        );
    }
    let dir = std::env::var("DSA_PTX_DIR").ok().filter(|_| write);
    if let Some(dir) = dir {
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {dir}: {e}"));
        let path = format!("{dir}/{name}.ptx");
        std::fs::write(&path, src).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}

#[test]
fn every_kernel_compiles_for_sm90a() {
    if !nvrtc_present() {
        assert!(
            std::env::var("DSA_REQUIRE_NVRTC").is_err()
                && std::env::var("DSA_REQUIRE_GPU").is_err(),
            "libnvrtc not found but DSA_REQUIRE_NVRTC / DSA_REQUIRE_GPU is set"
        );
        eprintln!("no libnvrtc, skipping");
        return;
    }
    let variants = Variant::all();
    assert!(
        variants.contains(&Variant::Topk) && variants.contains(&Variant::Validate),
        "top-k and validation kernels listed"
    );
    let mut failures = Vec::new();
    let mut modules = 0;
    let hooks: Vec<(&str, Hooks)> = std::iter::once(("production", Hooks::default()))
        .chain(Hooks::each())
        .collect();
    for (hook, h) in hooks {
        let write = h == Hooks::default();
        // Under a hook, a module's name says which.
        let named = |n: String| if write { n } else { format!("{n} [{hook}]") };
        for v in &variants {
            match v {
                Variant::Logits { .. } => {
                    // Every kernel that can serve the variant, the host's pick among them:
                    // the wgmma kernels of its shape and the mma.sync fallback
                    // (mma_sync_only).
                    let serving = kernels::logits_kernels(*v);
                    assert!(
                        serving.contains(&kernels::logits_kernel(*v, h).0),
                        "{} [{hook}]: the host's kernel is one of {serving:?}",
                        v.name()
                    );
                    for kernel in serving {
                        // Under a hook, only the modules whose source it changes.
                        let src = |h| kernels::logits_source(*v, kernel, h);
                        if !write && src(h) == src(Hooks::default()) {
                            continue;
                        }
                        modules += 1;
                        let name = named(format!("{}.{kernel}", v.name()));
                        match compile_logits(*v, kernel, h) {
                            Ok(ptx) => {
                                check(&name, &ptx.to_src(), kernels::module_entries(kernel), write)
                            }
                            Err(e) => failures.push(format!("{name}: {e}")),
                        }
                    }
                }
                Variant::Topk | Variant::Validate => {
                    let entries: &[&str] = if *v == Variant::Topk {
                        &[
                            "topk_ragged_f32",
                            "topk_ragged_wide_f32",
                            "topk_cluster_f32",
                            "topk_short_f32",
                            "topk_segments_f32",
                            "topk_merge_f32",
                            "block_keys_f32",
                            "kept_blocks_u32",
                            "decode_codes",
                        ]
                    } else {
                        &["validate_inputs"]
                    };
                    if !write && v.source(h) == v.source(Hooks::default()) {
                        continue;
                    }
                    modules += 1;
                    let name = named(v.name());
                    match compile(*v, h) {
                        Ok(ptx) => check(&name, &ptx.to_src(), entries, write),
                        Err(e) => failures.push(format!("{name}: {e}")),
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {modules} modules failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
