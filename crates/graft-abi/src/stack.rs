//! Boxed stacks of `StableIValue`s: taking a kernel's arguments (and freeing everything they
//! own), writing its outputs, and building the stacks of calls into the dispatcher.
//!
//! Ownership rules of the stable ABI: a kernel receives owning tensor handles, owning list
//! handles and, for a non-`None` optional, an owning pointer to a heap cell holding the value;
//! returned tensors pass to libtorch. The same holds in the other direction for the arguments of
//! `torch_call_dispatcher`, which consumes them.

use crate::dtype::DType;
use crate::error::{check, Error, Result};
use crate::sys::{api, StableIValue, StableListHandle};
use crate::tensor::Tensor;

/// A schema value a kernel can receive: converting takes ownership of whatever the slot owns.
pub trait FromStable: Sized {
    /// # Safety
    /// `value` must be a slot of this schema type, owned by the caller and never used again.
    unsafe fn from_stable(value: StableIValue) -> Result<Self>;
}

/// A value that can be passed to the dispatcher: converting hands over ownership.
pub trait IntoStable {
    /// The slot, owned by whoever receives it.
    fn into_stable(self) -> Result<StableIValue>;
}

impl FromStable for Tensor {
    unsafe fn from_stable(value: StableIValue) -> Result<Tensor> {
        // SAFETY: a Tensor slot is an owning AtenTensorHandle (caller's contract).
        unsafe { Tensor::from_raw(value as usize as *mut _) }
    }
}

impl FromStable for i64 {
    unsafe fn from_stable(value: StableIValue) -> Result<i64> {
        Ok(value as i64)
    }
}

impl FromStable for f64 {
    unsafe fn from_stable(value: StableIValue) -> Result<f64> {
        Ok(f64::from_bits(value))
    }
}

impl FromStable for bool {
    unsafe fn from_stable(value: StableIValue) -> Result<bool> {
        // A bool is memcpy'd into the low byte of a zeroed slot.
        Ok(value & 0xff != 0)
    }
}

impl FromStable for DType {
    unsafe fn from_stable(value: StableIValue) -> Result<DType> {
        // A ScalarType travels as the shim's int32 code in the low four bytes (the codes
        // `load()` checked to be c10's).
        Ok(DType(value as u32 as i32))
    }
}

impl<T: FromStable> FromStable for Option<T> {
    unsafe fn from_stable(value: StableIValue) -> Result<Option<T>> {
        if value == 0 {
            return Ok(None);
        }
        let cell = value as usize as *mut StableIValue;
        // SAFETY: a non-None optional slot is an owning pointer to a heap cell holding the value.
        let inner = unsafe { cell.read() };
        free_cell(cell)?;
        // SAFETY: the cell held a slot of the inner type, now owned by us.
        unsafe { T::from_stable(inner) }.map(Some)
    }
}

impl<T: FromStable> FromStable for Vec<T> {
    unsafe fn from_stable(value: StableIValue) -> Result<Vec<T>> {
        let api = api()?;
        let list = value as usize as StableListHandle;
        let mut len = 0usize;
        // SAFETY: a list slot is an owning StableListHandle; reading its size does not consume it.
        let code = unsafe { (api.torch_list_size)(list, &mut len) };
        let read = check(code, "torch_list_size").and_then(|()| {
            (0..len)
                .map(|i| {
                    let mut item = 0;
                    // SAFETY: `i` is in bounds; the item slot becomes ours to convert.
                    let code = unsafe { (api.torch_list_get_item)(list, i, &mut item) };
                    check(code, "torch_list_get_item")?;
                    // SAFETY: each item is a slot of the element type, owned by the list and
                    // handed to us as the list is freed below (it frees only its buffer).
                    unsafe { T::from_stable(item) }
                })
                .collect::<Result<Vec<T>>>()
        });
        // SAFETY: we own the list handle; freeing it releases the vector, not the items.
        let code = unsafe { (api.torch_delete_list)(list) };
        check(code, "torch_delete_list")?;
        read
    }
}

impl IntoStable for Tensor {
    fn into_stable(self) -> Result<StableIValue> {
        Ok(self.into_raw() as usize as StableIValue)
    }
}

impl IntoStable for &Tensor {
    fn into_stable(self) -> Result<StableIValue> {
        self.new_ref()?.into_stable()
    }
}

impl IntoStable for i64 {
    fn into_stable(self) -> Result<StableIValue> {
        Ok(self as StableIValue)
    }
}

impl IntoStable for f64 {
    fn into_stable(self) -> Result<StableIValue> {
        Ok(self.to_bits())
    }
}

impl IntoStable for bool {
    fn into_stable(self) -> Result<StableIValue> {
        Ok(self as StableIValue)
    }
}

impl IntoStable for DType {
    fn into_stable(self) -> Result<StableIValue> {
        // A ScalarType travels as its int32 code in the low four bytes.
        Ok(self.0 as u32 as StableIValue)
    }
}

impl<T: IntoStable> IntoStable for Option<T> {
    fn into_stable(self) -> Result<StableIValue> {
        match self {
            None => Ok(0),
            Some(value) => {
                let inner = value.into_stable()?;
                let cell = new_cell()?;
                // SAFETY: `cell` is a fresh allocation of one StableIValue.
                unsafe { cell.write(inner) };
                Ok(cell as usize as StableIValue)
            }
        }
    }
}

impl<T: IntoStable + Copy> IntoStable for &[T] {
    fn into_stable(self) -> Result<StableIValue> {
        new_list(self.iter().map(|&v| v.into_stable()))
    }
}

impl IntoStable for Vec<Tensor> {
    fn into_stable(self) -> Result<StableIValue> {
        new_list(self.into_iter().map(IntoStable::into_stable))
    }
}

fn new_list(items: impl ExactSizeIterator<Item = Result<StableIValue>>) -> Result<StableIValue> {
    let api = api()?;
    let mut list: StableListHandle = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the list is owned by us until handed over.
    let code = unsafe { (api.torch_new_list_reserve_size)(items.len(), &mut list) };
    check(code, "torch_new_list_reserve_size")?;
    for item in items {
        let pushed = item.and_then(|item| {
            // SAFETY: `list` is our live list; pushing moves the item's ownership into it.
            let code = unsafe { (api.torch_list_push_back)(list, item) };
            check(code, "torch_list_push_back")
        });
        if let Err(e) = pushed {
            // SAFETY: we own the list; freeing it on the error path (items pushed so far leak,
            // which only an allocation failure can cause).
            unsafe { (api.torch_delete_list)(list) };
            return Err(e);
        }
    }
    Ok(list as usize as StableIValue)
}

/// Allocates a heap cell for an optional's value the way this libtorch frees it.
fn new_cell() -> Result<*mut StableIValue> {
    let api = api()?;
    let cell = match api.torch_new_stable_ivalue {
        Some(new) => {
            let mut cell = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            check(unsafe { new(&mut cell) }, "torch_new_stable_ivalue")?;
            cell
        }
        // torch < 2.13 allocates cells with `new StableIValue` and frees them with `delete`.
        // SAFETY: operator new either returns 8 usable bytes or throws on exhaustion, which
        // aborts the process through the C frame, as in C++.
        None => unsafe { (api.operator_new)(std::mem::size_of::<StableIValue>()) }.cast(),
    };
    if cell.is_null() {
        return Err(Error::msg("could not allocate an optional value cell"));
    }
    Ok(cell)
}

/// Frees a heap cell received as an optional's slot.
fn free_cell(cell: *mut StableIValue) -> Result<()> {
    let api = api()?;
    match api.torch_delete_stable_ivalue {
        // SAFETY: the cell was allocated by libtorch for us and is freed exactly once here.
        Some(delete) => check(unsafe { delete(cell) }, "torch_delete_stable_ivalue"),
        None => {
            // SAFETY: on torch < 2.13 libtorch allocates cells with `new StableIValue`.
            unsafe { (api.operator_delete)(cell.cast()) };
            Ok(())
        }
    }
}

/// A kernel's argument list, in schema order.
pub trait KernelArgs: Sized {
    /// How many arguments the schema has.
    const COUNT: usize;
    /// Takes every argument, freeing all of them even when one fails to convert.
    ///
    /// # Safety
    /// `stack` must hold `COUNT` owned slots of the matching schema types.
    unsafe fn take(stack: *const StableIValue) -> Result<Self>;
}

/// A kernel's outputs, in schema order.
pub trait KernelOutputs {
    /// How many values the schema returns.
    const COUNT: usize;
    /// Writes the outputs to the stack, handing them to libtorch.
    ///
    /// # Safety
    /// `stack` must have room for `COUNT` slots.
    unsafe fn put(self, stack: *mut StableIValue) -> Result<()>;
}

/// Arguments for a dispatcher call, in schema order.
pub trait CallArgs {
    /// Converts every argument, handing over ownership.
    fn into_slots(self) -> Result<Vec<StableIValue>>;
}

/// What a dispatcher call returns, in schema order.
pub trait CallOutputs: Sized {
    /// How many values the schema returns.
    const COUNT: usize;
    /// # Safety
    /// `stack` must hold `COUNT` owned return slots of the matching schema types.
    unsafe fn take(stack: *const StableIValue) -> Result<Self>;
}

macro_rules! tuple_impls {
    ($count:expr; $($t:ident $i:tt),+) => {
        impl<$($t: FromStable),+> KernelArgs for ($($t,)+) {
            const COUNT: usize = $count;
            unsafe fn take(stack: *const StableIValue) -> Result<Self> {
                // Convert every slot before failing, so that each one is freed.
                // SAFETY: the caller guarantees `COUNT` owned slots of these types.
                let taken = ($(unsafe { $t::from_stable(stack.add($i).read()) },)+);
                Ok(($(taken.$i?,)+))
            }
        }

        impl<$($t: FromStable),+> CallOutputs for ($($t,)+) {
            const COUNT: usize = $count;
            unsafe fn take(stack: *const StableIValue) -> Result<Self> {
                // SAFETY: as above.
                unsafe { <Self as KernelArgs>::take(stack) }
            }
        }

        impl<$($t: IntoStable),+> CallArgs for ($($t,)+) {
            fn into_slots(self) -> Result<Vec<StableIValue>> {
                Ok(vec![$(self.$i.into_stable()?),+])
            }
        }

        impl<$($t: IntoStable),+> KernelOutputs for ($($t,)+) {
            const COUNT: usize = $count;
            unsafe fn put(self, stack: *mut StableIValue) -> Result<()> {
                // SAFETY: the caller guarantees room for `COUNT` slots.
                $(unsafe { stack.add($i).write(self.$i.into_stable()?) };)+
                Ok(())
            }
        }
    };
}

/// A schema that returns nothing (an op that only mutates its arguments, e.g. in-place optimizer
/// steps).
impl KernelOutputs for () {
    const COUNT: usize = 0;
    unsafe fn put(self, _stack: *mut StableIValue) -> Result<()> {
        Ok(())
    }
}

tuple_impls!(1; A 0);
tuple_impls!(2; A 0, B 1);
tuple_impls!(3; A 0, B 1, C 2);
tuple_impls!(4; A 0, B 1, C 2, D 3);
tuple_impls!(5; A 0, B 1, C 2, D 3, E 4);
tuple_impls!(6; A 0, B 1, C 2, D 3, E 4, F 5);
tuple_impls!(7; A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_impls!(8; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
tuple_impls!(9; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
tuple_impls!(10; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
tuple_impls!(11; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);
tuple_impls!(12; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11);
tuple_impls!(13; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12);
tuple_impls!(14; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13);
tuple_impls!(15; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14);

/// A dispatcher call of an operator that returns nothing.
impl CallOutputs for () {
    const COUNT: usize = 0;
    unsafe fn take(_stack: *const StableIValue) -> Result<()> {
        Ok(())
    }
}
