//! Checks that need no GPU: the embedded fatbin and what happens without a driver.

use graft_cuda::fatbin::{self, EntryKind};
use graft_cuda::{DType, ErrorKind, RmsNormBackward, RmsNormForward, Weight, WeightMode};

/// True when the build was given `NVCC` (then the kernels must be there).
fn nvcc_requested() -> bool {
    env!("GRAFT_CUDA_NVCC_REQUESTED") == "1"
}

#[test]
fn kernels_are_built_when_nvcc_is_given() {
    if nvcc_requested() {
        assert!(
            graft_cuda::kernels_built(),
            "NVCC was set but no fatbin was embedded"
        );
    }
    assert_eq!(graft_cuda::kernels_built(), fatbin::fatbin().is_some());
    assert_eq!(
        graft_cuda::kernels_built(),
        fatbin::ptxas_report().is_some()
    );
}

#[test]
fn fatbin_has_sass_for_each_arch_and_compute_90_ptx() {
    let Some(bytes) = fatbin::fatbin() else {
        assert!(!nvcc_requested());
        return;
    };
    assert_eq!(
        bytes.as_ptr() as usize % 64,
        0,
        "the fatbin must be aligned"
    );
    assert_eq!(
        u32::from_le_bytes(bytes[..4].try_into().unwrap()),
        fatbin::FATBIN_MAGIC
    );
    let entries = fatbin::entries(bytes).expect("a well-formed fatbin");
    let has = |kind, arch| entries.iter().any(|e| e.kind == kind && e.arch == arch);
    assert!(has(EntryKind::Elf, 80), "{entries:?}");
    assert!(has(EntryKind::Elf, 90), "{entries:?}");
    assert!(has(EntryKind::Ptx, 90), "{entries:?}");
    // Every entry has a real payload (at least 64 KB for ~160 kernels).
    assert!(
        entries.iter().all(|e| e.payload_bytes > 65_536),
        "{entries:?}"
    );
}

#[test]
fn every_launched_kernel_is_compiled_for_every_arch_without_spills() {
    let Some(report) = fatbin::ptxas_report() else {
        assert!(!nvcc_requested());
        return;
    };
    let bytes = fatbin::fatbin().unwrap();
    let names = graft_cuda::kernel_names();
    assert!(names.len() > 100);
    let archs: Vec<u32> = fatbin::entries(bytes)
        .unwrap()
        .iter()
        .filter(|e| e.kind == EntryKind::Elf)
        .map(|e| e.arch)
        .collect();
    for arch in &archs {
        let compiled = fatbin::compiled_kernels(report, *arch);
        for n in &names {
            assert!(compiled.contains(&n.as_str()), "{n} missing for sm_{arch}");
        }
        // Nothing compiled that the library does not know how to launch.
        assert_eq!(compiled.len(), names.len(), "sm_{arch}");
    }
    let usage = fatbin::resource_usage(report);
    assert_eq!(usage.len(), names.len() * archs.len());
    for k in &usage {
        assert_eq!(
            (k.spill_store_bytes, k.spill_load_bytes, k.stack_bytes),
            (0, 0, 0),
            "{} spills on sm_{}",
            k.name,
            k.arch
        );
        assert!(k.registers <= 255);
    }
}

#[test]
fn without_a_driver_calls_fail_cleanly() {
    let count = graft_cuda::device_count();
    let Err(e) = count else {
        // A machine with a driver: nothing to check here (the self-test covers it).
        return;
    };
    assert_eq!(e.kind(), ErrorKind::DriverUnavailable, "{e}");
    assert!(e.to_string().contains("libcuda.so.1"), "{e}");
    // Valid-looking arguments reach the driver check and get the same error, no panic.
    let f = RmsNormForward {
        device: 0,
        stream: 0,
        dtype: DType::BF16,
        x: 0x1000,
        weight: Weight::Same(0x2000),
        y: 0x3000,
        rstd: 0x4000,
        rows: 8,
        cols: 4096,
        eps: 1e-6,
        mode: WeightMode::default(),
    };
    let e = graft_cuda::rms_norm_forward(&f).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
    let b = RmsNormBackward {
        device: 0,
        stream: 0,
        dtype: DType::BF16,
        dy: 0x1000,
        x: 0x2000,
        rstd: 0x3000,
        weight: Weight::Same(0x4000),
        dx: Some(0x5000),
        dw: Some(0x6000),
        workspace: 0x7000,
        workspace_bytes: 1 << 20,
        rows: 8,
        cols: 4096,
        mode: WeightMode::default(),
    };
    let e = graft_cuda::rms_norm_backward(&b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
    let e = graft_cuda::rms_norm_backward_workspace_bytes(0, 8, 4096, true).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
    // Without dw the workspace size needs no device.
    assert_eq!(
        graft_cuda::rms_norm_backward_workspace_bytes(0, 8, 4096, false),
        Ok(0)
    );
    assert!(graft_cuda::tools::DeviceBuffer::new(0, 16).is_err());
}
