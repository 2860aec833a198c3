//! The NVRTC path (what a GPU host without nvcc at build time runs, and what the CUDA tests use
//! by default): the embedded kernel sources, assembled into one translation unit, must compile
//! with NVRTC for sm_80 and sm_90, with an entry for every kernel of the typed launchers. Needs
//! libnvrtc only, no GPU. Without libnvrtc it prints "skipped: libnvrtc not found";
//! FERROLM_REQUIRE_NVRTC=1 (CI, which installs it) makes that a failure.
mod common;
use common::SOURCES;

#[test]
fn kernel_sources_compile_with_nvrtc() {
    if !ferrolm_cuda::nvrtc_available() {
        assert!(!std::env::var("FERROLM_REQUIRE_NVRTC").is_ok_and(|v| v == "1"), "FERROLM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded");
        println!("skipped: libnvrtc not found");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let ptx = ferrolm_cuda::compile_sources(SOURCES, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let text = ptx.to_src();
        for k in ferrolm_cuda::kernels::Kernel::NAMES {
            assert!(text.contains(&format!(".entry {k}(")), "{arch}: kernel {k} missing from the PTX");
        }
        assert!(text.contains("mma.sync.aligned.m16n8k16"), "{arch}: no tensor-core mma in the PTX");
        for feed in
            ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global"]
        {
            assert!(text.contains(feed), "{arch}: no {feed} in the PTX");
        }
        assert!(text.contains("cp.async.wait_group"), "{arch}: no cp.async.wait_group in the PTX");
    }
}

#[test]
fn translation_unit_inlines_each_header_once() {
    let tu = ferrolm_cuda::nvrtc_translation_unit(SOURCES).unwrap();
    assert!(!tu.contains("#include \"common.cuh\""), "an embedded header was not inlined");
    assert_eq!(tu.matches("// ---- common.cuh").count(), 1, "common.cuh inlined more than once");
    for (name, _) in SOURCES.iter().filter(|(n, _)| n.ends_with(".cu")) {
        assert_eq!(tu.matches(&format!("// ---- {name}\n")).count(), 1, "{name} must appear once");
    }
}
