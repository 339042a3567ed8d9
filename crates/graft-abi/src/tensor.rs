//! Tensor handles: owned (`Tensor`), and freshly allocated ones whose data may be written
//! (`NewTensor`).

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::dtype::{DType, Device, DeviceType, Element};
use crate::error::{check, Error, Result};
use crate::sys::{api, AtenTensorHandle, AtenTensorOpaque};

/// An owning handle to an `at::Tensor` (one reference), freed exactly once on drop.
#[derive(Debug)]
pub struct Tensor {
    handle: NonNull<AtenTensorOpaque>,
}

// SAFETY: the handle owns a heap-allocated `at::Tensor`, i.e. a reference-counted pointer to a
// TensorImpl; moving or sharing that between threads is what torch itself does.
unsafe impl Send for Tensor {}
// SAFETY: `&Tensor` only reads metadata through thread-safe stable-ABI getters.
unsafe impl Sync for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: we own this handle and this is the only place it is freed.
            unsafe { (api.aoti_torch_delete_tensor_object)(self.handle.as_ptr()) };
        }
    }
}

macro_rules! getter {
    ($self:ident, $func:ident, $ty:ty) => {
        getter!($self, $func, $ty, Default::default())
    };
    ($self:ident, $func:ident, $ty:ty, $init:expr) => {{
        let api = api()?;
        let mut out: $ty = $init;
        // SAFETY: the handle is valid for `self`'s lifetime and `out` is a valid out-pointer.
        let code = unsafe { (api.$func)($self.handle.as_ptr(), &mut out) };
        check(code, stringify!($func))?;
        out
    }};
}

impl Tensor {
    /// Takes ownership of a raw handle.
    ///
    /// # Safety
    /// `handle` must be a valid owning `AtenTensorHandle` that nobody else frees.
    pub unsafe fn from_raw(handle: AtenTensorHandle) -> Result<Tensor> {
        NonNull::new(handle)
            .map(|handle| Tensor { handle })
            .ok_or_else(|| Error::msg("null tensor handle"))
    }

    /// Gives up ownership: whoever receives the handle frees it.
    pub fn into_raw(self) -> AtenTensorHandle {
        let handle = self.handle.as_ptr();
        std::mem::forget(self);
        handle
    }

    /// The raw handle, still owned by `self`.
    pub fn as_raw(&self) -> AtenTensorHandle {
        self.handle.as_ptr()
    }

    /// Another owning handle to the same tensor (same storage, one more reference).
    pub fn new_ref(&self) -> Result<Tensor> {
        let api = api()?;
        let mut out = std::ptr::null_mut();
        // SAFETY: valid handle and out-pointer; the new handle is owned by the returned Tensor.
        let code = unsafe { (api.aoti_torch_new_tensor_handle)(self.as_raw(), &mut out) };
        check(code, "aoti_torch_new_tensor_handle")?;
        // SAFETY: torch returned a fresh owning handle.
        unsafe { Tensor::from_raw(out) }
    }

    /// An undefined tensor (what ATen returns for an output that was not asked for).
    pub fn undefined() -> Result<Tensor> {
        let api = api()?;
        let mut out = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the new handle is owned by the returned Tensor.
        let code = unsafe { (api.aoti_torch_new_uninitialized_tensor)(&mut out) };
        check(code, "aoti_torch_new_uninitialized_tensor")?;
        // SAFETY: torch returned a fresh owning handle.
        unsafe { Tensor::from_raw(out) }
    }

    /// Whether the tensor is defined (not `None`-like).
    pub fn is_defined(&self) -> Result<bool> {
        Ok(getter!(self, aoti_torch_is_defined, bool))
    }

    /// An optional tensor argument as ATen reads it: an undefined tensor means `None` (autograd
    /// passes a saved `None` weight as an undefined tensor, not as `None`).
    pub fn defined(optional: Option<Tensor>) -> Result<Option<Tensor>> {
        match optional {
            Some(t) if t.is_defined()? => Ok(Some(t)),
            _ => Ok(None),
        }
    }

    /// Scalar type.
    pub fn dtype(&self) -> Result<DType> {
        Ok(DType(getter!(self, aoti_torch_get_dtype, i32)))
    }

    /// Device type and index.
    pub fn device(&self) -> Result<Device> {
        let kind = DeviceType(getter!(self, aoti_torch_get_device_type, i32));
        let index = getter!(self, aoti_torch_get_device_index, i32);
        Ok(Device { kind, index })
    }

    /// Number of elements.
    pub fn numel(&self) -> Result<usize> {
        let n = getter!(self, aoti_torch_get_numel, i64);
        usize::try_from(n).map_err(|_| Error::msg(format!("negative numel {n}")))
    }

    /// Sizes, borrowed from the tensor's metadata.
    pub fn sizes(&self) -> Result<&[i64]> {
        let dim = getter!(self, aoti_torch_get_dim, i64);
        let ptr = getter!(self, aoti_torch_get_sizes, *mut i64, std::ptr::null_mut());
        // SAFETY: torch returns a pointer to `dim` sizes owned by the TensorImpl, which lives at
        // least as long as our reference to it; nothing here resizes the tensor.
        Ok(unsafe { raw_slice(ptr, dim) })
    }

    /// Strides in elements, borrowed from the tensor's metadata.
    pub fn strides(&self) -> Result<&[i64]> {
        let dim = getter!(self, aoti_torch_get_dim, i64);
        let ptr = getter!(self, aoti_torch_get_strides, *mut i64, std::ptr::null_mut());
        // SAFETY: as for `sizes`.
        Ok(unsafe { raw_slice(ptr, dim) })
    }

    /// Whether the tensor is contiguous in row-major order.
    pub fn is_contiguous(&self) -> Result<bool> {
        Ok(getter!(self, aoti_torch_is_contiguous, bool))
    }

    /// Whether the elements fill a dense block of memory in some order of the dimensions, with no
    /// overlap (ATen's `is_non_overlapping_and_dense`): contiguous or a permutation of it.
    pub fn is_dense(&self) -> Result<bool> {
        Ok(self.is_contiguous()? || is_dense(self.sizes()?, self.strides()?))
    }

    /// Address of the first element (device memory for CUDA tensors).
    pub fn data_ptr(&self) -> Result<*mut c_void> {
        Ok(getter!(
            self,
            aoti_torch_get_data_ptr,
            *mut c_void,
            std::ptr::null_mut()
        ))
    }

    /// The elements of a contiguous CPU tensor of dtype `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let (ptr, len) = self.host_elements::<T>()?;
        // SAFETY: `host_elements` checked dtype, device, contiguity and alignment; the storage
        // holds `len` elements from `ptr` and stays alive while `self` holds its reference.
        Ok(unsafe { raw_slice(ptr as *const T, len as i64) })
    }

    /// The elements a strided CPU tensor of dtype `T` spans: from its first element (at
    /// `data_ptr`) through its last, `1 + sum((size - 1) * stride)` elements (empty when it has
    /// none). Element `(i_0, ..., i_n)` is at `sum(i_k * stride_k)`; the elements in between
    /// may belong to other views of the storage.
    pub fn as_strided_slice<T: Element>(&self) -> Result<&[T]> {
        let (ptr, len) = self.host_span::<T>()?;
        // SAFETY: `host_span` checked dtype, device, alignment and non-negative strides; every
        // element of the view lies in its storage, so the span from the first to the last one
        // does too, and the storage stays alive while `self` holds its reference.
        Ok(unsafe { raw_slice(ptr as *const T, len as i64) })
    }

    fn host_span<T: Element>(&self) -> Result<(*mut T, usize)> {
        self.check_host::<T>()?;
        if self.numel()? == 0 {
            return Ok((NonNull::dangling().as_ptr(), 0));
        }
        let mut len = 1usize;
        for (&size, &stride) in self.sizes()?.iter().zip(self.strides()?) {
            crate::ensure!(stride >= 0, "negative stride {stride}");
            len += (size as usize - 1) * stride as usize;
        }
        let ptr = self.data_ptr()? as *mut T;
        crate::ensure!(
            (ptr as usize).is_multiple_of(std::mem::align_of::<T>()),
            "tensor data is not aligned for {}",
            T::DTYPE
        );
        Ok((ptr, len))
    }

    fn check_host<T: Element>(&self) -> Result<()> {
        let dtype = self.dtype()?;
        crate::ensure!(
            dtype == T::DTYPE,
            "expected a {} tensor, got {dtype}",
            T::DTYPE
        );
        let device = self.device()?;
        crate::ensure!(
            device.kind == DeviceType::CPU,
            "expected a CPU tensor, got {device}"
        );
        Ok(())
    }

    fn host_elements<T: Element>(&self) -> Result<(*mut T, usize)> {
        let dtype = self.dtype()?;
        crate::ensure!(
            dtype == T::DTYPE,
            "expected a {} tensor, got {dtype}",
            T::DTYPE
        );
        let device = self.device()?;
        crate::ensure!(
            device.kind == DeviceType::CPU,
            "expected a CPU tensor, got {device}"
        );
        crate::ensure!(self.is_contiguous()?, "expected a contiguous tensor");
        let len = self.numel()?;
        let ptr = self.data_ptr()? as *mut T;
        if len == 0 {
            return Ok((NonNull::dangling().as_ptr(), 0));
        }
        crate::ensure!(
            (ptr as usize).is_multiple_of(std::mem::align_of::<T>()),
            "tensor data is not aligned for {}",
            T::DTYPE
        );
        Ok((ptr, len))
    }

    /// Allocates an uninitialised tensor through torch's allocator.
    pub fn empty_strided(
        sizes: &[i64],
        strides: &[i64],
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        crate::ensure!(
            sizes.len() == strides.len(),
            "sizes and strides differ in length"
        );
        let api = api()?;
        let mut out = std::ptr::null_mut();
        // SAFETY: `sizes` and `strides` hold `len` elements each; `out` is a valid out-pointer and
        // the returned handle is owned by the new Tensor.
        let code = unsafe {
            (api.aoti_torch_empty_strided)(
                sizes.len() as i64,
                sizes.as_ptr(),
                strides.as_ptr(),
                dtype.0,
                device.kind.0,
                device.index,
                &mut out,
            )
        };
        check(code, "aoti_torch_empty_strided")?;
        // SAFETY: torch returned a fresh owning handle.
        unsafe { Tensor::from_raw(out) }
    }

    /// Copies `src` into `self` (broadcasting and converting like `Tensor.copy_`).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        let api = api()?;
        // SAFETY: both handles are valid; copy_ does not take ownership.
        check(
            unsafe { (api.aoti_torch_copy_)(self.as_raw(), src.as_raw(), 0) },
            "aoti_torch_copy_",
        )
    }
}

/// Writable views of the data of CPU tensors that an operator updates in place (the
/// `Tensor(a!)` arguments of its schema), one per tensor, in order, each in memory order.
///
/// Every tensor must be a CPU tensor of `T` whose elements fill a dense block of memory
/// ([`Tensor::is_dense`]), and no two may share memory: both are checked, so the views are
/// disjoint. The `&mut` borrows keep these handles from being viewed again while the views
/// live; a kernel asking for them views no other handle to the same data.
pub fn in_place_views<T: Element>(tensors: Vec<&mut Tensor>) -> Result<Vec<&mut [T]>> {
    let mut spans = Vec::with_capacity(tensors.len());
    for t in &tensors {
        let dtype = t.dtype()?;
        crate::ensure!(
            dtype == T::DTYPE,
            "expected a {} tensor, got {dtype}",
            T::DTYPE
        );
        let device = t.device()?;
        crate::ensure!(
            device.kind == DeviceType::CPU,
            "expected a CPU tensor, got {device}"
        );
        crate::ensure!(t.is_dense()?, "expected a dense tensor");
        let len = t.numel()?;
        let ptr = t.data_ptr()? as *mut T;
        if len == 0 {
            spans.push((NonNull::<T>::dangling().as_ptr(), 0));
            continue;
        }
        crate::ensure!(
            (ptr as usize).is_multiple_of(std::mem::align_of::<T>()),
            "tensor data is not aligned for {}",
            T::DTYPE
        );
        spans.push((ptr, len));
    }
    let bytes = |(ptr, len): (*mut T, usize)| {
        let start = ptr as usize;
        (start, start + len * std::mem::size_of::<T>())
    };
    for (i, &a) in spans.iter().enumerate() {
        for (j, &b) in spans.iter().enumerate().skip(i + 1) {
            let ((a0, a1), (b0, b1)) = (bytes(a), bytes(b));
            crate::ensure!(
                a0 == a1 || b0 == b1 || a1 <= b0 || b1 <= a0,
                "in-place arguments {i} and {j} share memory"
            );
        }
    }
    Ok(spans
        .into_iter()
        // SAFETY: each tensor was checked to be a CPU tensor of `T`, aligned, whose `len`
        // elements fill the block of memory that starts at its data pointer (dense, so every
        // stride is positive and the first element has the lowest address); the storage lives
        // as long as the borrowed handle. The spans were just checked to be pairwise
        // disjoint, so no two views alias, and the exclusive borrows keep these handles from
        // making other views.
        .map(|(ptr, len)| unsafe { std::slice::from_raw_parts_mut(ptr, len) })
        .collect())
}

/// A tensor this code just allocated and nobody else has seen: its data may be written.
#[derive(Debug)]
pub struct NewTensor(Tensor);

impl NewTensor {
    /// Allocates an uninitialised contiguous tensor.
    pub fn empty(sizes: &[i64], dtype: DType, device: Device) -> Result<NewTensor> {
        Ok(NewTensor(Tensor::empty_strided(
            sizes,
            &contiguous_strides(sizes),
            dtype,
            device,
        )?))
    }

    /// Allocates an uninitialised tensor with the given strides.
    pub fn empty_strided(
        sizes: &[i64],
        strides: &[i64],
        dtype: DType,
        device: Device,
    ) -> Result<NewTensor> {
        Ok(NewTensor(Tensor::empty_strided(
            sizes, strides, dtype, device,
        )?))
    }

    /// The elements of a CPU tensor allocated dense (every element of its storage span belongs
    /// to it, in any dimension order), writable, in memory order.
    pub fn as_mut_dense_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        crate::ensure!(
            is_dense(self.0.sizes()?, self.0.strides()?),
            "expected a tensor without gaps or overlaps"
        );
        let (ptr, len) = self.0.host_span::<T>()?;
        // SAFETY: as in `Tensor::as_strided_slice`; the span holds exactly the tensor's own
        // elements (dense: no gaps, no overlaps, checked above), and this tensor was freshly
        // allocated by us with no other handle to it (NewTensor never hands one out), so the
        // slice is unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    /// The elements of a contiguous CPU tensor, writable.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let (ptr, len) = self.0.host_elements::<T>()?;
        // SAFETY: as in `Tensor::as_slice`; in addition this tensor was freshly allocated by us and
        // no other handle to it exists (NewTensor never hands one out), so the slice is unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    /// Read access to metadata and data.
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// Finishes writing: the tensor may now be shared.
    pub fn finish(self) -> Tensor {
        self.0
    }
}

/// Whether a tensor with these sizes and strides is non-overlapping and dense: its elements fill
/// `numel` consecutive slots in some order of the dimensions (size-1 dimensions may have any
/// stride).
pub fn is_dense(sizes: &[i64], strides: &[i64]) -> bool {
    if sizes.contains(&0) {
        return true;
    }
    let mut dims: Vec<(i64, i64)> = sizes
        .iter()
        .zip(strides)
        .filter(|(&size, _)| size != 1)
        .map(|(&size, &stride)| (stride, size))
        .collect();
    dims.sort_unstable();
    let mut expected = 1;
    for (stride, size) in dims {
        if stride != expected {
            return false;
        }
        expected *= size;
    }
    true
}

/// Row-major strides of a tensor with these sizes (as torch computes them: size-1 dims included).
pub fn contiguous_strides(sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * sizes[i + 1].max(1);
    }
    strides
}

/// # Safety
/// `ptr` must point to `len` initialised elements that outlive the returned slice (any pointer
/// when `len` is 0).
unsafe fn raw_slice<'a, T>(ptr: *const T, len: i64) -> &'a [T] {
    if len <= 0 {
        &[]
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(ptr, len as usize) }
    }
}

#[cfg(test)]
mod tests {
    use super::{contiguous_strides, is_dense};

    #[test]
    fn dense_layouts_are_permutations_without_gaps() {
        assert!(is_dense(&[2, 3, 4], &[12, 4, 1]));
        assert!(is_dense(&[2, 3, 4], &[12, 1, 3]), "permuted");
        assert!(
            is_dense(&[2, 1, 4], &[4, 99, 1]),
            "size-1 dims have any stride"
        );
        assert!(is_dense(&[0, 5], &[7, 7]));
        assert!(!is_dense(&[2, 3, 4], &[24, 4, 1]), "a gap");
        assert!(!is_dense(&[2, 3], &[0, 1]), "an overlap");
        assert!(!is_dense(&[3, 2], &[1, 1]), "an overlap");
    }

    #[test]
    fn contiguous_strides_match_torch() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[2, 3, 1]), vec![3, 1, 1]);
        assert_eq!(contiguous_strides(&[0, 1]), vec![1, 1]);
        assert_eq!(contiguous_strides(&[5]), vec![1]);
        assert_eq!(contiguous_strides(&[]), Vec::<i64>::new());
        assert_eq!(contiguous_strides(&[3, 0, 2]), vec![2, 2, 1]);
    }
}
