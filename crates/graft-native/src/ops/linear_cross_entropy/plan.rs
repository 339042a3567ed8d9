//! Which scheme a call runs, and with what sizes: the byte counts behind the choice.

/// Fewest rows per chunk: each chunk's `d_weight` update reads and writes the whole `(V, H)`
/// gradient, so small chunks are bound by that traffic (H100, 8192 tokens, 2048 -> 128256,
/// bf16: 34.1 ms with 256-row chunks, 22.5 ms with 1024-row ones, the same peak memory).
const MIN_CHUNK_ROWS: usize = 1024;

/// Rows per chunk when the caller leaves it to us: a logits buffer about the size of `hidden`
/// (`C V ~ N H`, Liger-Kernel's budget), in a power of two, at least [`MIN_CHUNK_ROWS`], at
/// most `rows`.
pub(crate) fn auto_chunk(rows: usize, hidden: usize, vocab: usize) -> usize {
    let budget = (rows as u128 * hidden as u128).div_ceil(vocab.max(1) as u128);
    let pow2 = (budget.max(1) as usize).next_power_of_two();
    pow2.max(MIN_CHUNK_ROWS).min(rows.max(1))
}

/// Classes per vocabulary block of the two-pass scheme (fewer when the vocabulary is smaller):
/// the fastest measured at 8192 tokens, 2048 -> 128256 on the H100 (blocks of 4096 or 6144
/// classes mean more, smaller GEMMs and more launches: 31-34 ms against 30.5).
const BLOCK_COLS: usize = 8192;

/// Sizes of the two-pass, vocabulary-blocked scheme: groups of `group_rows` rows, blocks of
/// `block_cols` classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TwoPass {
    pub group_rows: usize,
    pub block_cols: usize,
    /// Rows per partial product `g @ W_blk` added into a 16-bit `d_hidden`'s f32 accumulator
    /// (the group's rows in slices of this many: the partial product's buffer holds one).
    pub product_rows: usize,
}

/// How the op runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Row chunks of this many rows (full `(C, V)` logits per chunk).
    RowChunks(usize),
    /// Two passes over vocabulary blocks per group of rows.
    TwoPass(TwoPass),
}

/// Bytes of the logits buffer Liger-Kernel's fused linear cross-entropy allocates for the same
/// problem: chunks of `next_power_of_two(ceil(N / ceil(V / H)))` rows of `V` logits. The
/// two-pass scheme keeps its buffers within it, so that its peak (`d_weight`, `d_hidden` and
/// those buffers, as Liger's) is never above Liger-Kernel's: issue 13's memory bound.
fn liger_chunk_bytes(rows: usize, hidden: usize, vocab: usize, elem: usize) -> u128 {
    let ratio = vocab.div_ceil(hidden.max(1)).max(1);
    let chunk = rows
        .div_ceil(ratio)
        .max(1)
        .next_power_of_two()
        .min(rows.max(1));
    chunk as u128 * vocab as u128 * elem as u128
}

/// Bytes the two-pass scheme's buffers take with groups of `r` rows and blocks of `vb` classes:
/// the logits block, and for a 16-bit dtype the f32 accumulator of `d_hidden` (`4 H` a row) and
/// the f32 partial product added into it, half the group's rows at a time (on the CPU it is in
/// the dtype, counted as f32 all the same; f32 / f64 accumulate in `d_hidden` itself).
fn two_pass_bytes(r: usize, vb: usize, hidden: usize, elem: usize) -> u128 {
    let (r, h) = (r as u128, hidden as u128);
    let logits = r * vb as u128 * elem as u128;
    if elem == 2 {
        logits + 4 * h * r + 4 * h * r.div_ceil(2)
    } else {
        logits
    }
}

/// The two-pass scheme's sizes for `rows x hidden -> vocab` in elements of `elem` bytes.
///
/// Blocks of [`BLOCK_COLS`] classes (at most `V`); groups of every row if the buffers
/// ([`two_pass_bytes`]) fit within [`liger_chunk_bytes`] less the scheme's five f32 per-row
/// vectors, else of the largest power of two of rows that fits (at least 1); partial products
/// of half a group's rows.
///
/// Llama 3.2 1B's head at 8192 tokens (2048 -> 128256), bf16: Liger-Kernel's chunk is 256 rows
/// (62.6 MiB); 2048-row groups take 32 MiB of logits, 16 MiB of accumulator and 8 MiB of
/// partial product, 56 MiB. Peak: 501 MiB (d_weight) + 32 (d_hidden) + 56 = 589 MiB, against
/// Liger's 596 (and 784 for the row chunks); 29.6-30.6 ms against Liger's 34.4-35.2 on the H100.
pub(crate) fn two_pass_sizes(rows: usize, hidden: usize, vocab: usize, elem: usize) -> TwoPass {
    let (n, v) = (rows.max(1), vocab.max(1));
    let block_cols = BLOCK_COLS.min(v);
    let budget = liger_chunk_bytes(n, hidden, v, elem).saturating_sub(5 * 4 * n as u128);
    let fits = |r: usize| two_pass_bytes(r, block_cols, hidden, elem) <= budget;
    let group_rows = if fits(n) {
        n
    } else {
        let mut r = 1usize << n.ilog2();
        while r > 1 && !fits(r) {
            r /= 2;
        }
        r
    };
    TwoPass {
        group_rows,
        block_cols,
        product_rows: group_rows.div_ceil(2),
    }
}

/// The scheme for a call: row chunks, of `chunk_size` rows or (`chunk_size == 0`) of
/// [`auto_chunk`] rows. The one place to change the rule.
///
/// The two-pass scheme is the low-memory choice, taken only when asked for: measured on the
/// H100 (bf16, forward + backward, 8192 tokens, 2048 -> 128256) row chunks take 21.5 ms and
/// +784 MiB, two passes 31.9 ms and +565 MiB (Liger-Kernel 34.3 ms, +596 MiB); at 4096 tokens
/// 10.7 against 21.7 ms (docs/losses.md).
///
/// `TORCHGRAFT_LCE_SCHEME` (read at each call) chooses: `rows` row chunks (of `chunk_size`, or
/// automatic), `two-pass` the two-pass scheme with [`two_pass_sizes`], `R,Vb` the two-pass
/// scheme with groups of `R` rows and blocks of `Vb` classes, whatever `chunk_size` is.
pub(crate) fn choose_scheme(
    rows: usize,
    hidden: usize,
    vocab: usize,
    elem: usize,
    chunk_size: usize,
) -> Scheme {
    let rows_scheme = || {
        Scheme::RowChunks(if chunk_size == 0 {
            auto_chunk(rows, hidden, vocab)
        } else {
            chunk_size.min(rows.max(1))
        })
    };
    match std::env::var("TORCHGRAFT_LCE_SCHEME")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("rows") => return rows_scheme(),
        Some("two-pass") => return Scheme::TwoPass(two_pass_sizes(rows, hidden, vocab, elem)),
        Some(v) => {
            if let Some(sizes) = parse_two_pass(v, rows, vocab) {
                return Scheme::TwoPass(sizes);
            }
        }
        None => {}
    }
    rows_scheme()
}

/// `R,Vb` or `R,Vb,P` (all positive): groups of `R` rows, blocks of `Vb` classes, partial
/// products of `P` rows (`R` when not given), each at most what the problem has.
fn parse_two_pass(spec: &str, rows: usize, vocab: usize) -> Option<TwoPass> {
    let sizes: Vec<usize> = spec
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&x| x > 0))
        .collect::<Option<_>>()?;
    let (r, b, p) = match sizes[..] {
        [r, b] => (r, b, r),
        [r, b, p] => (r, b, p),
        _ => return None,
    };
    let group_rows = r.min(rows.max(1));
    Some(TwoPass {
        group_rows,
        block_cols: b.min(vocab.max(1)),
        product_rows: p.min(group_rows),
    })
}

#[cfg(test)]
mod tests {
    use super::{
        auto_chunk, choose_scheme, liger_chunk_bytes, parse_two_pass, two_pass_bytes,
        two_pass_sizes, Scheme, TwoPass,
    };

    fn sizes(group_rows: usize, block_cols: usize, product_rows: usize) -> TwoPass {
        TwoPass {
            group_rows,
            block_cols,
            product_rows,
        }
    }

    #[test]
    fn two_pass_buffers_stay_within_ligers_chunk() {
        // Llama 3.2 1B's head, bf16: at 8192 tokens Liger's chunk is 256 rows of 128256
        // logits (62.6 MiB); 2048-row groups take 32 + 16 + 8 = 56 MiB.
        assert_eq!(liger_chunk_bytes(8192, 2048, 128_256, 2), 256 * 128_256 * 2);
        assert_eq!(
            two_pass_sizes(8192, 2048, 128_256, 2),
            sizes(2048, 8192, 1024)
        );
        assert_eq!(two_pass_bytes(2048, 8192, 2048, 2), 56 << 20);
        // At 4096 tokens Liger's chunk is 128 rows (31.3 MiB): 1024-row groups, 28 MiB.
        assert_eq!(
            two_pass_sizes(4096, 2048, 128_256, 2),
            sizes(1024, 8192, 512)
        );
        // f32 needs no accumulator: 2048 rows of 8192 logits (64 MiB of Liger's 125).
        assert_eq!(
            two_pass_sizes(8192, 2048, 128_256, 4),
            sizes(2048, 8192, 1024)
        );
        // Few rows, a small vocabulary: blocks never wider than it.
        assert_eq!(two_pass_sizes(6, 4, 7, 8).block_cols, 7);
        // Every shape: one group of every row or a power of two of them, within the budget
        // unless a single row exceeds it.
        for &(n, h, v, e) in &[
            (8192, 4096, 128_256, 2),
            (100_000, 1000, 50_000, 2),
            (6000, 768, 50_257, 2),
            (37, 24, 50, 2),
            (1, 2048, 128_256, 2),
            (65_536, 4096, 32_000, 4),
        ] {
            let s = two_pass_sizes(n, h, v, e);
            assert!(s.group_rows == n || s.group_rows.is_power_of_two(), "{s:?}");
            assert_eq!(s.block_cols, v.min(8192));
            assert_eq!(s.product_rows, s.group_rows.div_ceil(2));
            let budget = liger_chunk_bytes(n, h, v, e) - 5 * 4 * n as u128;
            assert!(
                s.group_rows == 1 || two_pass_bytes(s.group_rows, s.block_cols, h, e) <= budget,
                "{n} {h} {v} {e}: {s:?}"
            );
        }
    }

    #[test]
    fn two_pass_sizes_parse() {
        assert_eq!(
            parse_two_pass("2048,8192", 8192, 128_256),
            Some(sizes(2048, 8192, 2048))
        );
        assert_eq!(
            parse_two_pass(" 2048 , 8192 , 512 ", 8192, 128_256),
            Some(sizes(2048, 8192, 512))
        );
        // At most what the problem has.
        assert_eq!(
            parse_two_pass("4096,8192,4096", 100, 50),
            Some(sizes(100, 50, 100))
        );
        for bad in [
            "",
            "2048",
            "0,8192",
            "2048,8192,0",
            "a,b",
            "1,2,3,4",
            "-1,5",
        ] {
            assert_eq!(parse_two_pass(bad, 8192, 128_256), None, "{bad:?}");
        }
    }

    #[test]
    fn automatic_scheme_is_row_chunks() {
        // (TORCHGRAFT_LCE_SCHEME is not set under cargo test.)
        assert_eq!(
            choose_scheme(8192, 2048, 128_256, 2, 0),
            Scheme::RowChunks(1024)
        );
        // A chunk size asks for row chunks of that size.
        assert_eq!(
            choose_scheme(8192, 2048, 128_256, 2, 2048),
            Scheme::RowChunks(2048)
        );
        assert_eq!(
            choose_scheme(65_536, 4096, 32_000, 2, 0),
            Scheme::RowChunks(16_384)
        );
    }

    #[test]
    fn automatic_chunks_hold_about_the_hidden_states() {
        // Llama 3.2 1B's head at 8192 tokens: 8192 * 2048 / 128256 = 131 -> 1024 rows.
        assert_eq!(auto_chunk(8192, 2048, 128_256), 1024);
        // Never fewer than 1024 rows, never more than there are.
        assert_eq!(auto_chunk(100_000, 64, 128_256), 1024);
        assert_eq!(auto_chunk(100, 2048, 32_000), 100);
        assert_eq!(auto_chunk(0, 2048, 32_000), 1);
        // A narrow vocabulary: the buffer grows with the hidden states.
        assert_eq!(auto_chunk(65_536, 4096, 32_000), 16_384);
    }
}
