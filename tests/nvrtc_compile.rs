//! Every kernel variant compiles for sm_90a with NVRTC (no GPU needed). CI installs
//! NVRTC 13.0.88 and runs this with `DSA_REQUIRE_NVRTC=1`, under which a missing
//! libnvrtc fails instead of skipping.
#![cfg(feature = "cuda")]

use dsa_indexer::cuda::kernels::{self, compile, nvrtc_present, Variant};
use dsa_indexer::problem::Format;

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
    for v in &variants {
        match compile(*v) {
            Ok(ptx) => {
                let src = ptx.to_src();
                assert!(
                    src.contains(".target sm_90a"),
                    "{}: not sm_90a PTX",
                    v.name()
                );
                // Every kernel the backend loads by name is in its module.
                let entries: &[&str] = match v {
                    // The wgmma kernel the host picks, its A/B alternatives, and the
                    // mma.sync fallback (WGMMA=0).
                    Variant::Logits {
                        q: Format::E4m3, ..
                    } if kernels::logits_wgmma(*v) => {
                        &["mqa_logits", "mqa_logits_w8", "mqa_logits_w16"]
                    }
                    Variant::Logits { .. } if kernels::logits_wgmma(*v) => {
                        &["mqa_logits", "mqa_logits_wgr"]
                    }
                    Variant::Logits { .. } => &["mqa_logits"],
                    Variant::Topk => &[
                        "topk_ragged_f32",
                        "topk_segments_f32",
                        "topk_merge_f32",
                        "block_keys_f32",
                        "kept_blocks_u32",
                        "decode_codes",
                    ],
                    Variant::Validate => &["validate_inputs"],
                };
                for e in entries {
                    assert!(
                        src.contains(&format!(".entry {e}(")),
                        "{}: no entry {e}",
                        v.name()
                    );
                }
                if let Ok(dir) = std::env::var("DSA_PTX_DIR") {
                    std::fs::write(format!("{dir}/{}.ptx", v.name()), src).unwrap();
                }
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} variants failed:\n{}",
        failures.len(),
        variants.len(),
        failures.join("\n")
    );
}
