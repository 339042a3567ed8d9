//! Unit tests of the operand checks, on described tensors (CUDA ones included: no GPU needed).

use super::*;

const CUDA0: Device = Device {
    kind: DeviceType::CUDA,
    index: 0,
};

fn meta<'a>(device: Device, dtype: DType, sizes: &'a [i64], strides: &'a [i64]) -> Meta<'a> {
    Meta {
        device,
        dtype,
        sizes,
        strides,
        data: 0x1000,
    }
}

fn at(m: Meta<'_>, data: usize) -> Meta<'_> {
    Meta { data, ..m }
}

#[test]
fn a_cpu_operand_of_a_cuda_kernel_is_refused_with_atens_message() {
    let target = meta(Device::CPU, DType::I64, &[4], &[1]);
    let logits = meta(CUDA0, DType::F32, &[4, 8], &[8, 1]);
    let e = Operands::new("cross_entropy", DeviceType::CUDA)
        .tensor("logits", &logits)
        .float()
        .tensor("target", &target)
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "Expected all tensors to be on the same device, but found at least two devices, \
         cuda:0 and cpu!"
    );
    // The same mistake the other way round: the first operand on the CPU.
    let e = Operands::new("cross_entropy", DeviceType::CUDA)
        .tensor("target", &target)
        .tensor("logits", &logits)
        .check()
        .unwrap_err();
    assert!(e.message().contains("cuda:0 and cpu"), "{e}");
    // Two GPUs.
    let other = meta(Device { index: 1, ..CUDA0 }, DType::F32, &[4, 8], &[8, 1]);
    let e = Operands::new("op", DeviceType::CUDA)
        .tensor("a", &logits)
        .tensor("b", &other)
        .check()
        .unwrap_err();
    assert!(e.message().contains("cuda:0 and cuda:1"), "{e}");
}

#[test]
fn a_kernel_refuses_a_call_on_another_device_type() {
    let x = meta(Device::CPU, DType::F32, &[4], &[1]);
    let e = Operands::new("rope", DeviceType::CUDA)
        .tensor("q", &x)
        .check()
        .unwrap_err();
    assert_eq!(e.message(), "rope: expected cuda tensors, got q on cpu");
    let meta_x = meta(Device::META, DType::F32, &[4], &[1]);
    let e = Operands::new("rope", DeviceType::CPU)
        .tensor("q", &meta_x)
        .check()
        .unwrap_err();
    assert!(e.message().contains("got q on meta"), "{e}");
}

#[test]
fn any_device_operands_are_not_compared() {
    let p = meta(CUDA0, DType::F32, &[4], &[1]);
    let lr = meta(Device::CPU, DType::F64, &[], &[]);
    let ok = Operands::new("adam", DeviceType::CUDA)
        .tensor("lr", &lr)
        .any_device()
        .tensor("param", &p)
        .float()
        .check()
        .unwrap();
    assert_eq!(ok.device, CUDA0);
}

#[test]
fn dtypes_and_sizes_follow_the_declared_rules() {
    let gate = meta(Device::CPU, DType::F32, &[2, 3], &[3, 1]);
    let long = meta(Device::CPU, DType::I64, &[2, 3], &[3, 1]);
    let e = Operands::new("swiglu", DeviceType::CPU)
        .tensor("gate", &long)
        .float()
        .check()
        .unwrap_err();
    assert_eq!(e.message(), "\"swiglu\" not implemented for 'Long'");
    let e = Operands::new("swiglu", DeviceType::CPU)
        .tensor("gate", &gate)
        .float()
        .tensor("up", &long)
        .like("gate")
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "swiglu: expected up to have dtype Float, got Long"
    );
    let small = meta(Device::CPU, DType::F32, &[2], &[1]);
    let e = Operands::new("swiglu", DeviceType::CPU)
        .tensor("gate", &gate)
        .tensor("up", &small)
        .like("gate")
        .check()
        .unwrap_err();
    assert_eq!(e.message(), "swiglu: expected up of size [2, 3], got [2]");
    let e = Operands::new("ce", DeviceType::CPU)
        .tensor("target", &small)
        .dtype(DType::I64)
        .message("expected target dtype to be Long or Byte, but got {got}")
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "expected target dtype to be Long or Byte, but got Float"
    );
    let e = Operands::new("ce", DeviceType::CPU)
        .tensor("logits", &small)
        .dims(2)
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "ce: expected logits to have 2 dimensions, got 1"
    );
    let e = Operands::new("ce", DeviceType::CPU)
        .tensor("target", &small)
        .dims(1)
        .size(0, 5)
        .message("Expected input batch_size ({want}) to match target batch_size ({got}).")
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "Expected input batch_size (5) to match target batch_size (2)."
    );
}

#[test]
fn absent_optional_operands_take_no_rules() {
    let x = meta(Device::CPU, DType::F32, &[2, 3], &[3, 1]);
    let ok = Operands::new("rms_norm", DeviceType::CPU)
        .tensor("x", &x)
        .float()
        .optional::<Meta<'_>>("weight", None)
        .float()
        .sizes(&[3])
        .message("never used")
        .check()
        .unwrap();
    assert_eq!(ok.dtype, DType::F32);
}

#[test]
fn layouts() {
    let t = meta(Device::CPU, DType::F32, &[2, 3], &[1, 2]);
    let e = Operands::new("cross_entropy_", DeviceType::CPU)
        .written("logits", &t)
        .contiguous()
        .message("{op}: the logits must be contiguous to take the gradient in place")
        .check()
        .unwrap_err();
    assert_eq!(
        e.message(),
        "cross_entropy_: the logits must be contiguous to take the gradient in place"
    );
    assert!(Operands::new("op", DeviceType::CPU)
        .tensor("t", &t)
        .dense()
        .check()
        .is_ok());
    let gappy = meta(Device::CPU, DType::F32, &[2, 3], &[6, 1]);
    assert!(Operands::new("op", DeviceType::CPU)
        .tensor("t", &gappy)
        .dense()
        .check()
        .is_err());
    let p = meta(Device::CPU, DType::F32, &[2, 1], &[1, 7]);
    let g = meta(Device::CPU, DType::F32, &[2, 1], &[1, 1]);
    assert!(Operands::new("adam", DeviceType::CPU)
        .tensor("param", &p)
        .tensor("grad", &g)
        .layout_like("param")
        .check()
        .is_ok());
    let row_major = meta(Device::CPU, DType::F32, &[3, 1, 2], &[2, 9, 1]);
    assert!(is_row_major(&row_major));
    assert!(is_row_major(&meta(
        Device::CPU,
        DType::F32,
        &[0, 3],
        &[1, 7]
    )));
}

#[test]
fn overlap_of_address_spans() {
    let a = meta(Device::CPU, DType::F32, &[4], &[1]);
    assert_eq!(overlap(&a, &a), Overlap::Full);
    assert_eq!(overlap(&a, &at(a, 0x1010)), Overlap::No);
    assert_eq!(overlap(&a, &at(a, 0x1004)), Overlap::Partial);
    // Every other element of one buffer: the spans intersect, the elements do not.
    let even = meta(Device::CPU, DType::F32, &[4], &[2]);
    assert_eq!(overlap(&even, &at(even, 0x1004)), Overlap::TooHard);
    let empty = meta(Device::CPU, DType::F32, &[0, 4], &[4, 1]);
    assert_eq!(overlap(&a, &empty), Overlap::No);
    // The same bytes seen with two layouts.
    let t = meta(Device::CPU, DType::F32, &[2, 2], &[1, 2]);
    let u = meta(Device::CPU, DType::F32, &[2, 2], &[2, 1]);
    assert_eq!(overlap(&t, &u), Overlap::Partial);
}

#[test]
fn written_operands_share_no_memory() {
    let gate = meta(Device::CPU, DType::F32, &[4], &[1]);
    let up = at(gate, 0x1008);
    let e = Operands::new("swiglu_backward_", DeviceType::CPU)
        .written("gate", &gate)
        .written("up", &up)
        .check()
        .unwrap_err();
    assert!(
        e.message().contains("gate and up are both written to"),
        "{e}"
    );
    let e = Operands::new("swiglu_backward_", DeviceType::CPU)
        .written("gate", &gate)
        .written("up", &gate)
        .check()
        .unwrap_err();
    assert!(e.message().contains("both written"), "{e}");
    // A read operand may be exactly a written one, not part of it.
    assert!(Operands::new("op", DeviceType::CPU)
        .written("gate", &gate)
        .tensor("grad", &gate)
        .check()
        .is_ok());
    let e = Operands::new("op", DeviceType::CPU)
        .tensor("grad", &up)
        .written("gate", &gate)
        .check()
        .unwrap_err();
    assert_eq!(e.message(), PARTIAL_OVERLAP);
    let expanded = meta(Device::CPU, DType::F32, &[4, 3], &[1, 0]);
    let e = Operands::new("op", DeviceType::CPU)
        .written("gate", &expanded)
        .check()
        .unwrap_err();
    assert_eq!(e.message(), INTERNAL_OVERLAP);
    // Strided views that interleave are not refused (ATen's "too hard" to tell).
    let even = meta(Device::CPU, DType::F32, &[4], &[2]);
    assert!(Operands::new("op", DeviceType::CPU)
        .written("a", &even)
        .written("b", &at(even, 0x1004))
        .check()
        .is_ok());
}
