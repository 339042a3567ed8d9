//! The operand checks of kernel entries: which tensors an entry takes, on which device, of which
//! dtypes, sizes and layouts, and which of them it writes, declared once per entry
//! ([`Operands`]) and checked before any data is touched, with the messages PyTorch gives for
//! the same mistakes.
//!
//! Why every entry needs them: the dispatcher picks one kernel from the devices of all tensor
//! arguments (meta over CUDA over CPU), so a CUDA kernel receives the CPU target of a CUDA loss,
//! and only these checks stand between that target and a kernel reading its host address as
//! device memory.
//!
//! ```no_run
//! # use graft_abi::{operands::Operands, DeviceType, Result, Tensor};
//! # fn f(gate: &Tensor, up: &Tensor) -> Result<()> {
//! let call = Operands::new("swiglu", DeviceType::CPU)
//!     .tensor("gate", gate)
//!     .float()
//!     .tensor("up", up)
//!     .like("gate")
//!     .check()?;
//! # let _ = call; Ok(()) }
//! ```

use crate::dtype::{DType, Device, DeviceType};
use crate::error::{Error, Result};
use crate::tensor::{is_dense, Tensor};

/// What the checks read of a tensor.
#[derive(Clone, Copy, Debug)]
pub struct Meta<'a> {
    pub device: Device,
    pub dtype: DType,
    pub sizes: &'a [i64],
    pub strides: &'a [i64],
    /// Address of the first element.
    pub data: usize,
}

impl Meta<'_> {
    /// Number of elements.
    pub fn numel(&self) -> i64 {
        self.sizes.iter().product()
    }

    /// The bytes from the first element through the last, `[start, end)`; `None` without
    /// elements. Torch's strides are never negative.
    fn span(&self) -> Option<(usize, usize)> {
        if self.numel() == 0 {
            return None;
        }
        let last: i64 = self
            .sizes
            .iter()
            .zip(self.strides)
            .map(|(&size, &stride)| (size - 1) * stride.max(0))
            .sum();
        let item = self.dtype.size().unwrap_or(1);
        Some((self.data, self.data + (last as usize + 1) * item))
    }

    fn is_dense(&self) -> bool {
        is_dense(self.sizes, self.strides)
    }

    /// ATen's internal overlap "yes": a dimension of stride 0 holds more than one element.
    fn overlaps_itself(&self) -> bool {
        self.sizes
            .iter()
            .zip(self.strides)
            .any(|(&size, &stride)| stride == 0 && size > 1)
    }
}

/// A tensor (or a description of one) the checks can read.
pub trait Describe {
    /// Its device, dtype, sizes, strides and address.
    fn describe(&self) -> Result<Meta<'_>>;
}

impl Describe for Tensor {
    fn describe(&self) -> Result<Meta<'_>> {
        Ok(Meta {
            device: self.device()?,
            dtype: self.dtype()?,
            sizes: self.sizes()?,
            strides: self.strides()?,
            data: self.data_ptr()? as usize,
        })
    }
}

impl Describe for Meta<'_> {
    fn describe(&self) -> Result<Meta<'_>> {
        Ok(*self)
    }
}

/// How the memory of two tensors overlaps, as ATen's `get_overlap_status` tells it: `Full` for
/// the same elements in the same layout, `Partial` for dense tensors sharing some bytes,
/// `TooHard` for strided views whose byte ranges intersect (they may interleave without sharing
/// an element), `No` otherwise. Read from addresses, not storages: two allocations never
/// intersect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    No,
    Full,
    Partial,
    TooHard,
}

/// The overlap of `a` and `b` (see [`Overlap`]).
pub fn overlap(a: &Meta<'_>, b: &Meta<'_>) -> Overlap {
    let (Some(sa), Some(sb)) = (a.span(), b.span()) else {
        return Overlap::No;
    };
    if sa.1 <= sb.0 || sb.1 <= sa.0 {
        return Overlap::No;
    }
    let same_layout = a.data == b.data && a.sizes == b.sizes && a.strides == b.strides;
    if same_layout && a.dtype.size() == b.dtype.size() {
        return Overlap::Full;
    }
    if a.is_dense() && b.is_dense() {
        Overlap::Partial
    } else {
        Overlap::TooHard
    }
}

/// ATen's message for a written tensor whose elements share memory (`assert_no_internal_overlap`).
pub const INTERNAL_OVERLAP: &str = "unsupported operation: more than one element of the \
     written-to tensor refers to a single memory location. Please clone() the tensor before \
     performing the operation.";

/// ATen's message for a written tensor that shares memory with an input
/// (`assert_no_partial_overlap`).
pub const PARTIAL_OVERLAP: &str = "unsupported operation: some elements of the input tensor and \
     the written-to tensor refer to a single memory location. Please clone() the tensor before \
     performing the operation.";

/// The message of two written tensors that share memory.
const WRITTEN_OVERLAP: &str = "unsupported operation: {name} and {want} are both written to and \
     some of their elements refer to a single memory location. Please clone() the tensor before \
     performing the operation.";

/// Which dtypes an operand may have.
#[derive(Clone, Copy, Debug)]
enum Dtypes<'a> {
    Any,
    /// float32, float64, bfloat16 or float16.
    Float,
    /// Exactly this one.
    Is(DType),
    /// The dtype of the operand of this name.
    Like(&'a str),
}

/// Which devices an operand may be on.
#[derive(Clone, Copy, Debug)]
enum Devices {
    /// The call's device: that of the first such operand, of the kernel's device type.
    Call,
    /// Any (read by copying, like `Tensor.item()`).
    Any,
}

/// Which sizes an operand may have (beyond its number of dimensions).
#[derive(Clone, Debug)]
enum Sizes<'a> {
    Any,
    Exactly(Vec<i64>),
    Like(&'a str),
    /// This size at this dimension (which must exist).
    At(usize, i64),
    Numel(i64),
}

/// Which memory layouts an operand may have (any layout with non-negative strides by default:
/// the kernels copy what they cannot read in place).
#[derive(Clone, Copy, Debug)]
enum Layout<'a> {
    Any,
    Contiguous,
    /// Non-overlapping and dense: contiguous in some order of the dimensions.
    Dense,
    /// The sizes of the named operand, and its strides where the size is not 1.
    Like(&'a str),
}

/// A rule of an operand, to attach a message to (in the order they are checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    Device,
    Dtype,
    Dims,
    Sizes,
    Layout,
}

/// One declared operand.
struct Operand<'a> {
    name: &'a str,
    tensor: &'a dyn Describe,
    written: bool,
    device: Devices,
    dtype: Dtypes<'a>,
    dims: Option<usize>,
    sizes: Sizes<'a>,
    layout: Layout<'a>,
    messages: [Option<&'a str>; 5],
}

/// The operands of one entry and what each must be; [`Operands::check`] checks them in the
/// order they were declared (device, dtype, sizes, layout of each), then the memory the written
/// ones share with the others.
///
/// Each rule has a default message; [`Operands::message`] replaces the message of the rule set
/// last, with `{op}`, `{name}`, `{want}` and `{got}` standing for the op's and the operand's
/// names, what the rule wants and what it found.
pub struct Operands<'a> {
    op: &'a str,
    kernel: DeviceType,
    list: Vec<Operand<'a>>,
    /// The rule set last on the last operand ([`Operands::message`]'s target).
    last_rule: Option<Rule>,
    /// Set by an absent optional operand: the rules that follow it have no operand to apply to.
    skipping: bool,
}

/// What a successful check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    /// The call's device.
    pub device: Device,
    /// The first operand's dtype.
    pub dtype: DType,
}

impl<'a> Operands<'a> {
    /// The operands of `op`'s kernel at `kernel` (the device type it computes on).
    pub fn new(op: &'a str, kernel: DeviceType) -> Operands<'a> {
        Operands {
            op,
            kernel,
            list: Vec::with_capacity(4),
            last_rule: None,
            skipping: false,
        }
    }

    fn push(mut self, name: &'a str, tensor: &'a dyn Describe, written: bool) -> Self {
        self.list.push(Operand {
            name,
            tensor,
            written,
            device: Devices::Call,
            dtype: Dtypes::Any,
            dims: None,
            sizes: Sizes::Any,
            layout: Layout::Any,
            messages: [None; 5],
        });
        self.last_rule = None;
        self.skipping = false;
        self
    }

    /// An operand the kernel reads: on the call's device, any dtype, size and layout until
    /// rules say otherwise.
    pub fn tensor(self, name: &'a str, tensor: &'a dyn Describe) -> Self {
        self.push(name, tensor, false)
    }

    /// An operand the kernel writes (a `Tensor(a!)` argument): no element may share memory
    /// with another of its own, with another written operand, or with part of a read one.
    pub fn written(self, name: &'a str, tensor: &'a dyn Describe) -> Self {
        self.push(name, tensor, true)
    }

    /// An optional operand the kernel reads; when absent, the rules that follow apply to
    /// nothing.
    pub fn optional<T: Describe>(self, name: &'a str, tensor: Option<&'a T>) -> Self {
        match tensor {
            Some(t) => self.tensor(name, t),
            None => {
                let mut s = self;
                s.skipping = true;
                s
            }
        }
    }

    fn rule(mut self, rule: Rule, set: impl FnOnce(&mut Operand<'a>)) -> Self {
        if self.skipping {
            return self;
        }
        let last = self
            .list
            .last_mut()
            .expect("a rule follows the operand it applies to");
        set(last);
        self.last_rule = Some(rule);
        self
    }

    /// A real floating dtype: float32, float64, bfloat16 or float16.
    pub fn float(self) -> Self {
        self.rule(Rule::Dtype, |o| o.dtype = Dtypes::Float)
    }

    /// Exactly `dtype`.
    pub fn dtype(self, dtype: DType) -> Self {
        self.rule(Rule::Dtype, |o| o.dtype = Dtypes::Is(dtype))
    }

    /// The dtype of operand `other`.
    pub fn dtype_like(self, other: &'a str) -> Self {
        self.rule(Rule::Dtype, |o| o.dtype = Dtypes::Like(other))
    }

    /// The dtype and sizes of operand `other`.
    pub fn like(self, other: &'a str) -> Self {
        self.dtype_like(other).sizes_like(other)
    }

    /// Exactly these sizes.
    pub fn sizes(self, sizes: &[i64]) -> Self {
        let sizes = sizes.to_vec();
        self.rule(Rule::Sizes, |o| o.sizes = Sizes::Exactly(sizes))
    }

    /// The sizes of operand `other`.
    pub fn sizes_like(self, other: &'a str) -> Self {
        self.rule(Rule::Sizes, |o| o.sizes = Sizes::Like(other))
    }

    /// This many dimensions (checked before the sizes).
    pub fn dims(self, dims: usize) -> Self {
        self.rule(Rule::Dims, |o| o.dims = Some(dims))
    }

    /// Size `size` at dimension `dim` (`{want}` and `{got}` are the sizes there).
    pub fn size(self, dim: usize, size: i64) -> Self {
        self.rule(Rule::Sizes, |o| o.sizes = Sizes::At(dim, size))
    }

    /// This many elements.
    pub fn numel(self, numel: i64) -> Self {
        self.rule(Rule::Sizes, |o| o.sizes = Sizes::Numel(numel))
    }

    /// Contiguous (row-major).
    pub fn contiguous(self) -> Self {
        self.rule(Rule::Layout, |o| o.layout = Layout::Contiguous)
    }

    /// Non-overlapping and dense (contiguous in some order of the dimensions).
    pub fn dense(self) -> Self {
        self.rule(Rule::Layout, |o| o.layout = Layout::Dense)
    }

    /// The sizes of operand `other`, and its strides where the size is not 1.
    pub fn layout_like(self, other: &'a str) -> Self {
        self.rule(Rule::Layout, |o| o.layout = Layout::Like(other))
    }

    /// On any device (the kernel reads it by copying, as `Tensor.item()` does).
    pub fn any_device(self) -> Self {
        self.rule(Rule::Device, |o| o.device = Devices::Any)
    }

    /// On the call's device, with this message when not.
    pub fn device_message(self, template: &'a str) -> Self {
        self.rule(Rule::Device, |o| o.device = Devices::Call)
            .message(template)
    }

    /// Replaces the message of the rule set last (see [`Operands`] for the placeholders).
    pub fn message(mut self, template: &'a str) -> Self {
        if self.skipping {
            return self;
        }
        let rule = self
            .last_rule
            .expect("a message follows the rule it replaces");
        let last = self.list.last_mut().expect("a rule has an operand");
        last.messages[rule as usize] = Some(template);
        self
    }

    /// Checks every rule; the first broken one gives the error.
    pub fn check(&self) -> Result<Checked> {
        let metas = self
            .list
            .iter()
            .map(|o| o.tensor.describe())
            .collect::<Result<Vec<_>>>()?;
        let call_device = self.call_device(&metas)?;
        for (o, m) in self.list.iter().zip(&metas) {
            self.check_device(o, m, call_device)?;
            self.check_dtype(o, m, &metas)?;
            self.check_sizes(o, m, &metas)?;
            self.check_layout(o, m, &metas)?;
        }
        self.check_overlaps(&metas)?;
        let first = metas
            .first()
            .ok_or_else(|| Error::msg(format!("{}: no operands declared", self.op)))?;
        Ok(Checked {
            device: call_device.unwrap_or(first.device),
            dtype: first.dtype,
        })
    }

    fn fail(&self, o: &Operand<'_>, rule: Rule, default: &str, want: &str, got: &str) -> Error {
        let template = o.messages[rule as usize].unwrap_or(default);
        Error::msg(
            template
                .replace("{op}", self.op)
                .replace("{name}", o.name)
                .replace("{want}", want)
                .replace("{got}", got),
        )
    }

    fn find<'m>(&self, metas: &'m [Meta<'m>], name: &str) -> Result<&'m Meta<'m>> {
        self.list
            .iter()
            .position(|o| o.name == name)
            .map(|i| &metas[i])
            .ok_or_else(|| Error::msg(format!("{}: no operand named {name}", self.op)))
    }

    /// The call's device: that of the first operand on a device of the kernel's type (an
    /// operand of another device, wherever it is, is then the mistake to report).
    fn call_device(&self, metas: &[Meta<'_>]) -> Result<Option<Device>> {
        let mut on_call = self
            .list
            .iter()
            .zip(metas)
            .filter(|(o, _)| matches!(o.device, Devices::Call));
        if let Some((_, m)) = on_call.clone().find(|(_, m)| m.device.kind == self.kernel) {
            return Ok(Some(m.device));
        }
        match on_call.next() {
            None => Ok(None),
            Some((o, m)) => {
                let (want, got) = (self.kernel.name(), m.device.to_string());
                let default = "{op}: expected {want} tensors, got {name} on {got}";
                Err(self.fail(o, Rule::Device, default, want, &got))
            }
        }
    }

    fn check_device(&self, o: &Operand<'_>, m: &Meta<'_>, call: Option<Device>) -> Result<()> {
        match (o.device, call) {
            (Devices::Call, Some(device)) if m.device != device => {
                let default = "Expected all tensors to be on the same device, but found at least \
                               two devices, {want} and {got}!";
                let (want, got) = (device.to_string(), m.device.to_string());
                Err(self.fail(o, Rule::Device, default, &want, &got))
            }
            _ => Ok(()),
        }
    }

    fn check_dtype(&self, o: &Operand<'_>, m: &Meta<'_>, metas: &[Meta<'_>]) -> Result<()> {
        let got = m.dtype;
        let (ok, want, default) = match o.dtype {
            Dtypes::Any => return Ok(()),
            Dtypes::Float => (
                got.is_float(),
                "a floating dtype".to_owned(),
                "\"{op}\" not implemented for '{got}'",
            ),
            Dtypes::Is(want) => (
                got == want,
                want.name().to_owned(),
                "{op}: expected {name} to have dtype {want}, got {got}",
            ),
            Dtypes::Like(other) => {
                let want = self.find(metas, other)?.dtype;
                (
                    got == want,
                    want.name().to_owned(),
                    "{op}: expected {name} to have dtype {want}, got {got}",
                )
            }
        };
        if ok {
            Ok(())
        } else {
            Err(self.fail(o, Rule::Dtype, default, &want, got.name()))
        }
    }

    fn check_sizes(&self, o: &Operand<'_>, m: &Meta<'_>, metas: &[Meta<'_>]) -> Result<()> {
        if let Some(want) = o.dims {
            if m.sizes.len() != want {
                let default = "{op}: expected {name} to have {want} dimensions, got {got}";
                let got = m.sizes.len().to_string();
                return Err(self.fail(o, Rule::Dims, default, &want.to_string(), &got));
            }
        }
        let sizes_default = "{op}: expected {name} of size {want}, got {got}".to_owned();
        let (ok, want, got, default) = match &o.sizes {
            Sizes::Any => return Ok(()),
            Sizes::Exactly(want) => (
                m.sizes == want.as_slice(),
                format!("{want:?}"),
                format!("{:?}", m.sizes),
                sizes_default,
            ),
            Sizes::Like(other) => {
                let want = self.find(metas, other)?.sizes;
                (
                    m.sizes == want,
                    format!("{want:?}"),
                    format!("{:?}", m.sizes),
                    sizes_default,
                )
            }
            Sizes::At(dim, want) => {
                let got = m.sizes.get(*dim);
                (
                    got == Some(want),
                    want.to_string(),
                    got.map_or_else(|| "no such dimension".to_owned(), i64::to_string),
                    format!("{{op}}: expected {{name}} of size {{want}} at dimension {dim}, got {{got}}"),
                )
            }
            Sizes::Numel(want) => (
                m.numel() == *want,
                want.to_string(),
                m.numel().to_string(),
                "{op}: {name} has {got} elements, expected {want}".to_owned(),
            ),
        };
        if ok {
            Ok(())
        } else {
            Err(self.fail(o, Rule::Sizes, &default, &want, &got))
        }
    }

    fn check_layout(&self, o: &Operand<'_>, m: &Meta<'_>, metas: &[Meta<'_>]) -> Result<()> {
        let (ok, want, default) = match o.layout {
            Layout::Any => return Ok(()),
            Layout::Contiguous => (
                is_row_major(m),
                "contiguous".to_owned(),
                "{op}: {name} must be contiguous",
            ),
            Layout::Dense => (
                m.is_dense(),
                "dense".to_owned(),
                "{op}: {name} must be dense (no gaps or overlaps between its elements)",
            ),
            Layout::Like(other) => {
                let p = self.find(metas, other)?;
                let same = p.sizes == m.sizes
                    && p.sizes
                        .iter()
                        .zip(p.strides.iter().zip(m.strides))
                        .all(|(&size, (a, b))| size == 1 || a == b);
                (
                    same,
                    format!("the layout of {other}"),
                    "{op}: {name} must have {want}",
                )
            }
        };
        if ok {
            Ok(())
        } else {
            Err(self.fail(o, Rule::Layout, default, &want, "another"))
        }
    }

    /// Written operands: no element shared within one, with another written one, or with part
    /// of a read one (a read operand that is exactly the written one is allowed: the kernels
    /// read each element before writing it, as ATen's in-place ops do).
    fn check_overlaps(&self, metas: &[Meta<'_>]) -> Result<()> {
        for (i, (o, m)) in self.list.iter().zip(metas).enumerate() {
            if !o.written {
                continue;
            }
            if m.overlaps_itself() {
                return Err(Error::msg(INTERNAL_OVERLAP));
            }
            for (j, (other, n)) in self.list.iter().zip(metas).enumerate() {
                if i == j || (other.written && j < i) {
                    continue;
                }
                match (overlap(m, n), other.written) {
                    (Overlap::No | Overlap::TooHard, _) | (Overlap::Full, false) => {}
                    (_, true) => {
                        let message = WRITTEN_OVERLAP
                            .replace("{name}", o.name)
                            .replace("{want}", other.name);
                        return Err(Error::msg(message));
                    }
                    (Overlap::Partial, false) => return Err(Error::msg(PARTIAL_OVERLAP)),
                }
            }
        }
        Ok(())
    }
}

/// Whether `m` has row-major strides (size-1 dims may have any stride, as in torch).
fn is_row_major(m: &Meta<'_>) -> bool {
    if m.sizes.contains(&0) {
        return true;
    }
    let mut expected = 1;
    for (&size, &stride) in m.sizes.iter().zip(m.strides).rev() {
        if size != 1 {
            if stride != expected {
                return false;
            }
            expected *= size;
        }
    }
    true
}

#[cfg(test)]
mod tests;
