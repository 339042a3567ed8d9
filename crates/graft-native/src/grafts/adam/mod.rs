//! Fused Adam / AdamW grafts: `aten::_fused_adam_` and `aten::_fused_adamw_`, each with its
//! float-lr and `tensor_lr` overloads, at CPU and CUDA.
//!
//! What every device shares lives here: the operator's arguments, which of the four overloads
//! a kernel serves, the list-length checks with ATen's messages, and reading one-element
//! tensors (steps, lr, grad scale) as numbers.

pub mod cpu;
pub mod cuda;

use std::marker::PhantomData;

use graft_abi::{ensure, DType, Device, FromStable, NewTensor, Result, Tensor};
use graft_kernels::ops::adam::Mode;

use crate::common::stats::Counters;

/// The learning rate argument: `float lr` (default overload) or `Tensor lr` (`tensor_lr`).
pub trait LrArg: FromStable + 'static {
    /// Whether this is the `tensor_lr` overload.
    const TENSOR: bool;
    /// The value, or the tensor holding it.
    fn lr(self) -> Lr;
}

/// A learning rate as the kernels receive it.
pub enum Lr {
    /// A number.
    Value(f64),
    /// A one-element tensor.
    Tensor(Tensor),
}

impl LrArg for f64 {
    const TENSOR: bool = false;
    fn lr(self) -> Lr {
        Lr::Value(self)
    }
}

impl LrArg for Tensor {
    const TENSOR: bool = true;
    fn lr(self) -> Lr {
        Lr::Tensor(self)
    }
}

/// Adam (`_fused_adam_`) or AdamW (`_fused_adamw_`), as a type.
pub trait Variant: 'static {
    /// The update.
    const MODE: Mode;
}

/// `aten::_fused_adam_`.
pub struct Adam;
/// `aten::_fused_adamw_`.
pub struct AdamW;

impl Variant for Adam {
    const MODE: Mode = Mode::Adam;
}

impl Variant for AdamW {
    const MODE: Mode = Mode::AdamW;
}

/// The kernel of one overload at one device key: `Step<AdamW, f64, Cpu>` serves
/// `aten::_fused_adamw_` at CPU, `Step<Adam, Tensor, Cuda>` `aten::_fused_adam_.tensor_lr` at
/// CUDA.
pub struct Step<V, L, D>(PhantomData<(V, L, D)>);

/// The schema's arguments, in order.
pub type Args<L> = (
    Vec<Tensor>,
    Vec<Tensor>,
    Vec<Tensor>,
    Vec<Tensor>,
    Vec<Tensor>,
    Vec<Tensor>,
    L,
    f64,
    f64,
    f64,
    f64,
    bool,
    bool,
    Option<Tensor>,
    Option<Tensor>,
);

/// The arguments by name.
pub struct Call {
    pub params: Vec<Tensor>,
    pub grads: Vec<Tensor>,
    pub exp_avgs: Vec<Tensor>,
    pub exp_avg_sqs: Vec<Tensor>,
    pub max_exp_avg_sqs: Vec<Tensor>,
    pub state_steps: Vec<Tensor>,
    pub lr: Lr,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
    pub amsgrad: bool,
    pub maximize: bool,
    pub grad_scale: Option<Tensor>,
    pub found_inf: Option<Tensor>,
}

impl Call {
    /// Names the arguments; undefined optional tensors count as absent.
    pub fn new<L: LrArg>(args: Args<L>) -> Result<Call> {
        let (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) =
            (args.0, args.1, args.2, args.3, args.4, args.5);
        Ok(Call {
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            lr: args.6.lr(),
            beta1: args.7,
            beta2: args.8,
            weight_decay: args.9,
            eps: args.10,
            amsgrad: args.11,
            maximize: args.12,
            grad_scale: Tensor::defined(args.13)?,
            found_inf: Tensor::defined(args.14)?,
        })
    }

    /// The list-length checks of ATen's kernels, with their messages.
    pub fn check_lengths(&self) -> Result<()> {
        let n = self.params.len();
        let expect = |ok: bool, what: &str| -> Result<()> {
            ensure!(ok, "Expected {what} to be true, but got false.");
            Ok(())
        };
        expect(self.grads.len() == n, "grads.size() == n_tensors")?;
        expect(self.exp_avgs.len() == n, "exp_avgs.size() == n_tensors")?;
        expect(
            self.exp_avg_sqs.len() == n,
            "exp_avg_sqs.size() == n_tensors",
        )?;
        if self.amsgrad {
            expect(
                self.max_exp_avg_sqs.len() == n,
                "max_exp_avg_sqs.size() == n_tensors",
            )?;
        } else {
            expect(self.max_exp_avg_sqs.is_empty(), "max_exp_avg_sqs.empty()")?;
        }
        expect(
            self.state_steps.len() == n,
            "state_steps.size() == n_tensors",
        )
    }

    /// The tensors parameter `i`'s step updates besides the parameter, by list name: its grad,
    /// moments and (with amsgrad) maximum of the second moments.
    pub fn moments(&self, i: usize) -> impl Iterator<Item = (&'static str, &Tensor)> {
        let lists = [
            ("grads", &self.grads),
            ("exp_avgs", &self.exp_avgs),
            ("exp_avg_sqs", &self.exp_avg_sqs),
            ("max_exp_avg_sqs", &self.max_exp_avg_sqs),
        ];
        let n = if self.amsgrad { 4 } else { 3 };
        lists
            .into_iter()
            .take(n)
            .map(move |(name, l)| (name, &l[i]))
    }

    /// The step's constants for the kernels of `graft_kernels::ops::adam`, with the lr given.
    pub fn hyper(
        &self,
        mode: Mode,
        lr: f64,
        grad_scale: Option<f32>,
    ) -> graft_kernels::ops::adam::Hyper {
        graft_kernels::ops::adam::Hyper {
            mode,
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            eps: self.eps,
            maximize: self.maximize,
            grad_scale,
        }
    }
}

/// Same sizes, and same strides where the size is not 1 (ATen's layout check of the lists).
pub fn same_layout(a: &Tensor, b: &Tensor) -> Result<bool> {
    has_layout(b, a.sizes()?, a.strides()?)
}

/// Whether `t` has these sizes, and these strides where the size is not 1.
pub fn has_layout(t: &Tensor, sizes: &[i64], strides: &[i64]) -> Result<bool> {
    if sizes != t.sizes()? {
        return Ok(false);
    }
    Ok(sizes
        .iter()
        .zip(strides.iter().zip(t.strides()?))
        .all(|(&size, (sa, sb))| size == 1 || sa == sb))
}

/// The value of a one-element tensor of any dtype and device, like `Tensor.item()`.
pub fn item(t: &Tensor) -> Result<f64> {
    let n = t.numel()?;
    ensure!(
        n == 1,
        "a Tensor with {n} elements cannot be converted to Scalar"
    );
    if t.device()? == Device::CPU && t.is_contiguous()? {
        match t.dtype()? {
            DType::F32 => return Ok(f64::from(t.as_slice::<f32>()?[0])),
            DType::F64 => return Ok(t.as_slice::<f64>()?[0]),
            _ => {}
        }
    }
    let host = NewTensor::empty(t.sizes()?, DType::F64, Device::CPU)?.finish();
    host.copy_from(t)?;
    Ok(host.as_slice::<f64>()?[0])
}

/// A `float` tensor argument read where ATen calls `data_ptr<float>()` on it.
pub fn float_arg(t: &Tensor) -> Result<()> {
    let dtype = t.dtype()?;
    ensure!(
        dtype == DType::F32,
        "expected scalar type Float but found {dtype}"
    );
    Ok(())
}

/// The counters of the kernel for (variant, lr kind) among the four of one device.
/// (`ADAM`, `ADAM_TENSOR_LR`, `ADAMW`, `ADAMW_TENSOR_LR` of the device's module).
pub fn counters<V: Variant, L: LrArg>(four: [&'static Counters; 4]) -> &'static Counters {
    let v = usize::from(V::MODE == Mode::AdamW);
    four[v * 2 + usize::from(L::TENSOR)]
}

/// Registers the four overloads' kernels for device `D` in `lib`.
pub fn register<D: 'static>(lib: &mut graft_abi::Library) -> Result<()>
where
    Step<AdamW, f64, D>: graft_abi::Kernel,
    Step<AdamW, Tensor, D>: graft_abi::Kernel,
    Step<Adam, f64, D>: graft_abi::Kernel,
    Step<Adam, Tensor, D>: graft_abi::Kernel,
{
    lib.register::<Step<AdamW, f64, D>>(c"_fused_adamw_")?;
    lib.register::<Step<AdamW, Tensor, D>>(c"_fused_adamw_.tensor_lr")?;
    lib.register::<Step<Adam, f64, D>>(c"_fused_adam_")?;
    lib.register::<Step<Adam, Tensor, D>>(c"_fused_adam_.tensor_lr")
}
