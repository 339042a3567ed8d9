//! The fatbin that build.rs compiled (when it could), and a reader for its header.

/// Bytes aligned for the driver, which reads the fatbin's 64-bit header fields in place.
#[cfg(graft_cuda_kernels)]
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

#[cfg(graft_cuda_kernels)]
static FATBIN: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/graft_cuda.fatbin"
)));

#[cfg(graft_cuda_kernels)]
static PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/graft_cuda_ptxas.txt"));

/// The embedded fatbin, if this build has one.
pub fn fatbin() -> Option<&'static [u8]> {
    #[cfg(graft_cuda_kernels)]
    {
        Some(&FATBIN.0)
    }
    #[cfg(not(graft_cuda_kernels))]
    {
        None
    }
}

/// nvcc's `-Xptxas -v` report for the embedded kernels (registers, shared memory, stack
/// and spills per kernel and architecture), if this build has kernels.
pub fn ptxas_report() -> Option<&'static str> {
    #[cfg(graft_cuda_kernels)]
    {
        Some(PTXAS_REPORT)
    }
    #[cfg(not(graft_cuda_kernels))]
    {
        None
    }
}

/// The fatbin magic number (`0xBA55ED50`, little endian).
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// Kind of an entry in a fatbin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// PTX for a virtual architecture (JIT-compiled by the driver).
    Ptx,
    /// An ELF cubin with SASS for one real architecture.
    Elf,
    /// Anything else (the raw kind value).
    Other(u16),
}

/// One entry of a fatbin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// PTX or SASS.
    pub kind: EntryKind,
    /// The architecture, e.g. 90 for `sm_90` / `compute_90`.
    pub arch: u32,
    /// Whether the payload is compressed.
    pub compressed: bool,
    /// Bytes of payload as stored.
    pub payload_bytes: u64,
}

/// Lists a fatbin's entries. Checks the magic and that the entries exactly fill the size
/// the header gives; `None` if the bytes are not such a fatbin.
///
/// Layout (little endian): header = magic u32, version u16, header size u16, payload size
/// u64; each entry = kind u16, (u16), header size u32, payload size u64, (u32 u32 u16 u16),
/// arch u32 at offset 28, ..., flags u64 at offset 40 (0x8000: compressed).
pub fn entries(bytes: &[u8]) -> Option<Vec<Entry>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    if u32_at(0)? != FATBIN_MAGIC {
        return None;
    }
    let header = usize::from(u16_at(6)?);
    let total = usize::try_from(u64_at(8)?).ok()?;
    let end = header.checked_add(total)?;
    if end != bytes.len() {
        return None;
    }
    let mut out = Vec::new();
    let mut off = header;
    while off < end {
        let kind = match u16_at(off)? {
            1 => EntryKind::Ptx,
            2 => EntryKind::Elf,
            k => EntryKind::Other(k),
        };
        let entry_header = usize::try_from(u32_at(off + 4)?).ok()?;
        let payload = u64_at(off + 8)?;
        let arch = u32_at(off + 28)?;
        let flags = u64_at(off + 40)?;
        if entry_header < 48 {
            return None;
        }
        out.push(Entry {
            kind,
            arch,
            compressed: flags & 0x8000 != 0,
            payload_bytes: payload,
        });
        off = off
            .checked_add(entry_header)?
            .checked_add(usize::try_from(payload).ok()?)?;
    }
    (off == end).then_some(out)
}

/// Kernel names that the ptxas report says were compiled for `sm_{arch}`.
pub fn compiled_kernels(report: &str, arch: u32) -> Vec<&str> {
    let suffix = format!("' for 'sm_{arch}'");
    report
        .lines()
        .filter_map(|l| l.split("Compiling entry function '").nth(1))
        .filter_map(|rest| rest.strip_suffix(suffix.as_str()))
        .collect()
}

/// Per kernel and architecture: (registers, stack bytes, spill store bytes, spill load
/// bytes), in report order.
pub fn resource_usage(report: &str) -> Vec<KernelResources> {
    let mut out = Vec::new();
    let mut name = "";
    let mut arch = 0;
    let mut frame = (0, 0, 0);
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some((n, a)) = rest.split_once("' for 'sm_") {
                name = n;
                arch = a.trim_end_matches('\'').parse().unwrap_or(0);
            }
        } else if line.contains("bytes stack frame") {
            let nums: Vec<u32> = line
                .split(',')
                .filter_map(|p| p.split_whitespace().next()?.parse().ok())
                .collect();
            if let [stack, stores, loads] = nums[..] {
                frame = (stack, stores, loads);
            }
        } else if let Some(rest) = line.split("Used ").nth(1) {
            if let Some(regs) = rest.split_whitespace().next().and_then(|r| r.parse().ok()) {
                out.push(KernelResources {
                    name: name.to_string(),
                    arch,
                    registers: regs,
                    stack_bytes: frame.0,
                    spill_store_bytes: frame.1,
                    spill_load_bytes: frame.2,
                });
            }
        }
    }
    out
}

/// One kernel's resources on one architecture, from the ptxas report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// Kernel (entry function) name.
    pub name: String,
    /// Architecture, e.g. 90.
    pub arch: u32,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread.
    pub stack_bytes: u32,
    /// Spill store bytes.
    pub spill_store_bytes: u32,
    /// Spill load bytes.
    pub spill_load_bytes: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_fatbin(entries: &[(u16, u32, u64)]) -> Vec<u8> {
        let mut body = Vec::new();
        for &(kind, arch, payload) in entries {
            let mut h = vec![0u8; 64];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[4..8].copy_from_slice(&64u32.to_le_bytes());
            h[8..16].copy_from_slice(&payload.to_le_bytes());
            h[28..32].copy_from_slice(&arch.to_le_bytes());
            h[40..48].copy_from_slice(&0x8011u64.to_le_bytes());
            body.extend_from_slice(&h);
            body.extend(std::iter::repeat_n(0xAB, payload as usize));
        }
        let mut out = Vec::new();
        out.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&16u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn parses_entries() {
        let bytes = fake_fatbin(&[(2, 80, 10), (1, 90, 7), (2, 90, 3)]);
        let e = entries(&bytes).expect("valid");
        assert_eq!(e.len(), 3);
        assert_eq!(
            (e[0].kind, e[0].arch, e[0].payload_bytes),
            (EntryKind::Elf, 80, 10)
        );
        assert_eq!((e[1].kind, e[1].arch), (EntryKind::Ptx, 90));
        assert!(e.iter().all(|e| e.compressed));
    }

    #[test]
    fn rejects_bad_fatbins() {
        let good = fake_fatbin(&[(2, 80, 10)]);
        let mut bad_magic = good.clone();
        bad_magic[0] ^= 1;
        assert_eq!(entries(&bad_magic), None);
        assert_eq!(entries(&good[..good.len() - 1]), None);
        assert_eq!(entries(&[]), None);
    }

    #[test]
    fn reads_ptxas_report() {
        let report = "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n\
            ptxas info    : Function properties for k1\n    \
            8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 40 registers, used 1 barriers, 256 bytes smem\n\
            ptxas info    : Compiling entry function 'k2' for 'sm_80'\n\
            ptxas info    : Function properties for k2\n    \
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 32 registers, used 0 barriers\n";
        assert_eq!(compiled_kernels(report, 90), vec!["k1"]);
        assert_eq!(compiled_kernels(report, 80), vec!["k2"]);
        let r = resource_usage(report);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (
                r[0].name.as_str(),
                r[0].arch,
                r[0].registers,
                r[0].stack_bytes
            ),
            ("k1", 90, 40, 8)
        );
        assert_eq!((r[0].spill_store_bytes, r[0].spill_load_bytes), (4, 12));
        assert_eq!(
            (r[1].name.as_str(), r[1].registers, r[1].spill_store_bytes),
            ("k2", 32, 0)
        );
    }
}
