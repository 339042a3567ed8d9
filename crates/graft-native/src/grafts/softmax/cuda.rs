//! Softmax and log-softmax on CUDA: graft-cuda's kernels (kernels/softmax.cu), launched on
//! PyTorch's current stream of the tensors' device, over a contiguous copy of any other layout
//! (as ATen's CUDA kernels do).
//!
//! `half_to_float` (a float16 input, float32 output) and its backward (float32 grad and output,
//! float16 grad_input) are computed by the kernels directly; errors follow ATen's CUDA kernels.
//!
//! A call the kernels were not measured faster on ([`measured_faster`]) is computed by ATen's own
//! kernel, through the `.out` overload of the same operator (structured in ATen: the same kernel
//! as the functional one, which this library does not graft), and counted as a fallback.

use std::sync::atomic::{AtomicBool, Ordering};

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{dispatch, ensure, DType, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{SoftmaxBackward, SoftmaxForward};

use super::{
    check_backward, check_forward, counters, expect_dtype, geometry, grad_input_dtype,
    not_implemented, wrap_dim, Backward, BackwardArgs, Forward, ForwardArgs, Kind, Shape, Which,
};
use crate::common::cuda::{cuda_error, kernel_dtype, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::contiguous;

/// Calls of `aten::_softmax` at CUDA.
pub static SOFTMAX: Counters = Counters::new();
/// Calls of `aten::_log_softmax` at CUDA.
pub static LOG_SOFTMAX: Counters = Counters::new();
/// Calls of `aten::_softmax_backward_data` at CUDA.
pub static SOFTMAX_BACKWARD: Counters = Counters::new();
/// Calls of `aten::_log_softmax_backward_data` at CUDA.
pub static LOG_SOFTMAX_BACKWARD: Counters = Counters::new();

/// The CUDA device, as a type.
pub struct Cuda;

/// Sends every call to the kernels when set to `always` at [`crate::enable`] (the kernels' tests
/// use it); by default a call goes to them only where they were [`measured_faster`].
pub const ALWAYS_ENV: &str = "TORCHGRAFT_CUDA_SOFTMAX";

/// [`ALWAYS_ENV`] as read by the last registration.
static ALWAYS: AtomicBool = AtomicBool::new(false);

/// Whether the kernels were measured at least as fast as ATen's on this call (the H100,
/// bench/grafts_cuda.py, bf16, over the last dimension, widths 1024 to 262144; results in
/// bench/results/grafts_cuda-h100.json): bf16 and f16 rows (the same bytes through the same
/// kernels), except the log-softmax backward at widths where ATen's own kernel is as fast.
/// float32 and float64, a dtype conversion (`half_to_float` and its backward) and other
/// dimensions were not measured faster and go to ATen.
fn measured_faster(
    kind: Kind,
    backward: bool,
    dtype: DType,
    converts: bool,
    shape: &Shape,
) -> bool {
    let width_ok = match (kind, backward) {
        // Softmax 1.3x-2.4x ATen at every width; the log-softmax forward 1.1x-2.0x.
        (Kind::Softmax, _) | (Kind::LogSoftmax, false) => true,
        // 1.4x at 1024; 0.92x-1.0x at 4096-16384; 1.23x-1.33x at 32768-262144 (the bulk
        // kernels above 32768); wider rows not measured.
        (Kind::LogSoftmax, true) => shape.dim <= 1024 || (32768..=262144).contains(&shape.dim),
    };
    let fast = matches!(dtype, DType::BF16 | DType::F16) && !converts;
    ALWAYS.load(Ordering::Relaxed) || fast && shape.inner == 1 && width_ok
}

impl<W: Which> Kernel for Forward<W, Cuda> {
    type Args = ForwardArgs;
    type Outputs = (Tensor,);

    fn run((input, dim, half_to_float): ForwardArgs) -> Result<(Tensor,)> {
        let counter = counters::<W>([&SOFTMAX, &LOG_SOFTMAX]);
        counter.call();
        check_forward::<W>(DeviceType::CUDA, &input)?;
        let sizes = input.sizes()?;
        let d = wrap_dim(dim, sizes.len())?;
        let dtype = input.dtype()?;
        let out_dtype = if half_to_float { DType::F32 } else { dtype };
        ensure!(
            !half_to_float || dtype == DType::F16,
            "conversion is supported for Half type only"
        );
        let device = input.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let out = NewTensor::empty(sizes, out_dtype, device)?.finish();
        if input.numel()? == 0 {
            return Ok((out,));
        }
        if !dtype.is_float() {
            return Err(not_implemented("host_softmax", dtype));
        }
        let shape = geometry(sizes, d);
        if !measured_faster(W::KIND, false, dtype, half_to_float, &shape) {
            counter.fallback();
            let op = if W::KIND == Kind::LogSoftmax {
                c"aten::_log_softmax"
            } else {
                c"aten::_softmax"
            };
            let (_,): (Tensor,) = dispatch::call(op, c"out", (&input, dim, half_to_float, &out))?;
            return Ok((out,));
        }
        let x = contiguous(&input)?;
        graft_cuda::softmax_forward(&SoftmaxForward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            log: W::KIND == Kind::LogSoftmax,
            input: kernel_dtype(dtype),
            output: kernel_dtype(out_dtype),
            x: ptr(&x)?,
            y: ptr(&out)?,
            outer: shape.outer,
            dim: shape.dim,
            inner: shape.inner,
        })
        .map_err(cuda_error)?;
        Ok((out,))
    }
}

impl<W: Which> Kernel for Backward<W, Cuda> {
    type Args = BackwardArgs;
    type Outputs = (Tensor,);

    fn run((grad, output, dim, input_dtype): BackwardArgs) -> Result<(Tensor,)> {
        let counter = counters::<W>([&SOFTMAX_BACKWARD, &LOG_SOFTMAX_BACKWARD]);
        counter.call();
        check_backward::<W>(DeviceType::CUDA, &grad, &output)?;
        let sizes = grad.sizes()?;
        let d = wrap_dim(dim, sizes.len())?;
        let dtype = grad.dtype()?;
        ensure!(
            dtype == input_dtype || (dtype == DType::F32 && input_dtype == DType::F16),
            "expected input and grad types to match, or input to be at::Half and grad to be \
             at::Float"
        );
        let out_dtype = grad_input_dtype(dtype, input_dtype);
        let device = grad.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let out = NewTensor::empty(sizes, out_dtype, device)?.finish();
        if grad.numel()? == 0 {
            return Ok((out,));
        }
        if !out_dtype.is_float() {
            return Err(not_implemented("host_softmax_backward", out_dtype));
        }
        // ATen reads grad and output as the grad's type (float32 under half_to_float).
        expect_dtype(dtype, output.dtype()?)?;
        let shape = geometry(sizes, d);
        if !measured_faster(W::KIND, true, dtype, dtype != input_dtype, &shape) {
            counter.fallback();
            let op = if W::KIND == Kind::LogSoftmax {
                c"aten::_log_softmax_backward_data"
            } else {
                c"aten::_softmax_backward_data"
            };
            let args = (&grad, &output, dim, input_dtype, &out);
            let (_,): (Tensor,) = dispatch::call(op, c"out", args)?;
            return Ok((out,));
        }
        let (dy, y) = (contiguous(&grad)?, contiguous(&output)?);
        graft_cuda::softmax_backward(&SoftmaxBackward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            log: W::KIND == Kind::LogSoftmax,
            grad: kernel_dtype(dtype),
            grad_input: kernel_dtype(out_dtype),
            dy: ptr(&dy)?,
            y: ptr(&y)?,
            dx: ptr(&out)?,
            outer: shape.outer,
            dim: shape.dim,
            inner: shape.inner,
        })
        .map_err(cuda_error)?;
        Ok((out,))
    }
}

/// Registers the four CUDA kernels in `lib` (an `aten` implementation library at CUDA).
pub fn register(lib: &mut graft_abi::Library) -> Result<()> {
    let always = std::env::var(ALWAYS_ENV).is_ok_and(|v| v == "always");
    ALWAYS.store(always, Ordering::Relaxed);
    lib.register::<Forward<super::Softmax, Cuda>>(c"_softmax")?;
    lib.register::<Forward<super::LogSoftmax, Cuda>>(c"_log_softmax")?;
    lib.register::<Backward<super::Softmax, Cuda>>(c"_softmax_backward_data")?;
    lib.register::<Backward<super::LogSoftmax, Cuda>>(c"_log_softmax_backward_data")
}
