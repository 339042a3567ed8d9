//! The kernel table as the runtime sees it: every entry point's name and what it asks of the
//! loader, in the order the ops declare them (`crate::kernel_table`). A kernel's index in this
//! table is its index in a device's loaded functions.

use std::sync::OnceLock;

/// What a kernel needs set when the module is loaded, beyond the driver's defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LoadAttrs {
    /// May take more than the default 48 KB of dynamic shared memory: opted in to the
    /// device's largest per-block amount.
    pub large_smem: bool,
    /// Runs in clusters larger than the portable 8 blocks (where the device has clusters).
    /// The driver's answer is not checked: where it refuses, an occupancy query finds no such
    /// cluster resident, and the op plans without it.
    pub large_cluster: bool,
}

/// One entry point of the embedded module.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    pub name: String,
    pub attrs: LoadAttrs,
}

impl Kernel {
    /// A kernel with the driver's default attributes.
    pub fn plain(name: String) -> Kernel {
        Kernel {
            name,
            attrs: LoadAttrs::default(),
        }
    }
}

/// Every kernel, in table order (built once).
pub(crate) fn table() -> &'static [Kernel] {
    static TABLE: OnceLock<Box<[Kernel]>> = OnceLock::new();
    TABLE.get_or_init(|| crate::kernel_table().into_boxed_slice())
}

/// The entry-point name of kernel `i`.
pub(crate) fn name(i: usize) -> String {
    table()
        .get(i)
        .map_or_else(|| format!("<kernel {i}>"), |k| k.name.clone())
}
