//! MoE token permutation (the sort by expert, permute, unpermute with and without weights, and unpermute's
//! backward) against f64 references, for every dtype and the weight dtypes the kernels take,
//! with sentinel slots (`valid < S`), K = 1, one token, no tokens, zero-width rows, and on
//! parallel schedules that split the rows. Outputs are poisoned with NaN first.

mod common;

use common::*;
use graft_kernels::ops::moe_permute::{
    first_out_of_range, permute, sort, unpermute, unpermute_backward, Permutation,
};
use graft_kernels::{Float, Parallel, Serial, Threads};
use half::{bf16, f16};

/// (tokens, top_k, hidden).
const SHAPES: [(usize, usize, usize); 7] = [
    (1, 1, 1),
    (1, 4, 8),
    (7, 1, 5),
    (64, 4, 32),
    (33, 8, 17),
    (300, 2, 96),
    (0, 3, 4),
];

/// A random permutation of `0..n` (Fisher-Yates) and its inverse.
fn permutation(rng: &mut Rng, n: usize) -> (Vec<i64>, Vec<i64>) {
    let mut perm: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        perm.swap(i, j);
    }
    let mut inv = vec![0i64; n];
    for (s, &p) in perm.iter().enumerate() {
        inv[p as usize] = s as i64;
    }
    (perm, inv)
}

/// The numbers of real slots to try: all, none, and some.
fn valids(n: usize) -> Vec<usize> {
    let mut v = vec![n, 0, n / 2, n.saturating_sub(1)];
    v.sort_unstable();
    v.dedup();
    v
}

struct Case {
    shape: Permutation,
    perm: Vec<i64>,
    inv: Vec<i64>,
}

fn ref_permute(c: &Case, hidden: &[f64]) -> Vec<f64> {
    let h = c.shape.hidden;
    let mut out = vec![0.0; c.shape.pairs() * h];
    for s in 0..c.shape.valid {
        let t = c.perm[s] as usize / c.shape.top_k;
        out[s * h..(s + 1) * h].copy_from_slice(&hidden[t * h..(t + 1) * h]);
    }
    out
}

fn ref_unpermute(c: &Case, y: &[f64], w: Option<&[f64]>) -> Vec<f64> {
    let (h, k) = (c.shape.hidden, c.shape.top_k);
    let mut out = vec![0.0; c.shape.tokens * h];
    for p in 0..c.shape.pairs() {
        let s = c.inv[p] as usize;
        if s >= c.shape.valid {
            continue;
        }
        let wp = w.map_or(1.0, |w| w[p]);
        for j in 0..h {
            out[(p / k) * h + j] += wp * y[s * h + j];
        }
    }
    out
}

/// (dy, dweights) of the f64 reference.
fn ref_backward(c: &Case, g: &[f64], y: &[f64], w: Option<&[f64]>) -> (Vec<f64>, Vec<f64>) {
    let (h, k) = (c.shape.hidden, c.shape.top_k);
    let mut dy = vec![0.0; c.shape.pairs() * h];
    let mut dw = vec![0.0; c.shape.pairs()];
    for s in 0..c.shape.valid {
        let p = c.perm[s] as usize;
        let wp = w.map_or(1.0, |w| w[p]);
        for j in 0..h {
            dy[s * h + j] = wp * g[(p / k) * h + j];
            dw[p] += y[s * h + j] * g[(p / k) * h + j];
        }
    }
    (dy, dw)
}

fn check<T: TestFloat, W: TestFloat + Float<Acc = T::Acc>>(par: &dyn Parallel, weighted: bool) {
    let mut rng = Rng::new(11);
    for (tokens, top_k, hidden) in SHAPES {
        let n = tokens * top_k;
        for valid in valids(n) {
            let (perm, inv) = permutation(&mut rng, n);
            let shape = Permutation {
                tokens,
                top_k,
                hidden,
                valid,
            };
            let c = Case { shape, perm, inv };
            let ctx = format!(
                "{}/{} weighted {weighted} tokens {tokens} top_k {top_k} hidden {hidden} valid {valid}",
                T::NAME,
                W::NAME
            );

            let x: Vec<T> = random(&mut rng, tokens * hidden, 1.0);
            let mut out: Vec<T> = poisoned(n * hidden);
            permute(shape, &x, &c.perm, &mut out, par);
            // A copy: exact.
            assert_eq!(
                to_f64(&out),
                ref_permute(&c, &to_f64(&x)),
                "permute ({ctx})"
            );

            let y: Vec<T> = random(&mut rng, n * hidden, 1.0);
            let w: Vec<W> = random(&mut rng, n, 1.0);
            let w = weighted.then_some(w.as_slice());
            let wf = w.map(to_f64);
            let mut out: Vec<T> = poisoned(tokens * hidden);
            unpermute(shape, &y, &c.inv, w, &mut out, par);
            let want = ref_unpermute(&c, &to_f64(&y), wf.as_deref());
            assert_close(&to_f64(&out), &want, T::TOL, "unpermute", &ctx);

            let g: Vec<T> = random(&mut rng, tokens * hidden, 1.0);
            let mut dy: Vec<T> = poisoned(n * hidden);
            let mut dw: Vec<W> = poisoned(n);
            let dw_out = weighted.then_some(dw.as_mut_slice());
            unpermute_backward(shape, &g, &y, &c.perm, &c.inv, w, &mut dy, dw_out, par);
            let (want_dy, want_dw) = ref_backward(&c, &to_f64(&g), &to_f64(&y), wf.as_deref());
            assert_close(&to_f64(&dy), &want_dy, T::TOL, "dy", &ctx);
            if weighted {
                assert_close(&to_f64(&dw), &want_dw, W::TOL.max(1e-6), "dweights", &ctx);
            }
        }
    }
}

fn check_all(par: &dyn Parallel) {
    for weighted in [false, true] {
        check::<f32, f32>(par, weighted);
        check::<f64, f64>(par, weighted);
        check::<bf16, bf16>(par, weighted);
        check::<bf16, f32>(par, weighted);
        check::<f16, f16>(par, weighted);
        check::<f16, f32>(par, weighted);
        check::<f32, bf16>(par, weighted);
    }
}

#[test]
fn permutation_matches_the_f64_reference_for_every_dtype() {
    for par in [&Serial as &dyn Parallel, &Threads(3), &ReverseChunks] {
        check_all(par);
    }
}

#[test]
fn sentinel_rows_are_zero_and_count_for_nothing() {
    // Two tokens, K = 2; slot 3 holds pair 1 (token 0's second expert), a sentinel.
    let shape = Permutation {
        tokens: 2,
        top_k: 2,
        hidden: 2,
        valid: 3,
    };
    let perm = [2i64, 0, 3, 1];
    let inv = [1i64, 3, 0, 2];
    let hidden = [1.0f32, 2.0, 3.0, 4.0];
    let mut out = [f32::NAN; 8];
    permute(shape, &hidden, &perm, &mut out, &Serial);
    assert_eq!(out, [3.0, 4.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0]);
    let y = [1.0f32, 1.0, 10.0, 10.0, 100.0, 100.0, f32::NAN, f32::NAN];
    let mut back = [0.0f32; 4];
    unpermute::<f32, f32>(shape, &y, &inv, None, &mut back, &Serial);
    // A NaN in a sentinel row does not reach the sum.
    assert_eq!(back, [10.0, 10.0, 101.0, 101.0]);
    let mut dy = [f32::NAN; 8];
    let mut dw = [f32::NAN; 4];
    let w = [0.5f32, 0.5, 0.25, 0.75];
    let g = [1.0f32, 2.0, 3.0, 4.0];
    unpermute_backward(
        shape,
        &g,
        &y,
        &perm,
        &inv,
        Some(&w[..]),
        &mut dy,
        Some(&mut dw[..]),
        &Serial,
    );
    assert_eq!(dy, [0.75, 1.0, 0.5, 1.0, 2.25, 3.0, 0.0, 0.0]);
    assert_eq!(dw, [30.0, 0.0, 7.0, 700.0]);
}

#[test]
fn out_of_range_indices_are_found() {
    assert_eq!(first_out_of_range(&[0, 1, 2], 3), None);
    assert_eq!(first_out_of_range(&[0, 3, 2], 3), Some((1, 3)));
    assert_eq!(first_out_of_range(&[0, 1, -1], 3), Some((2, -1)));
    assert_eq!(first_out_of_range(&[], 0), None);
}

/// The sort by expert against a comparison sort of `(expert, pair)`, with ids of other ranks
/// (negative and `>= experts`) sorting last, on random routings of every size class.
#[test]
fn sort_groups_pairs_by_expert_stably() {
    let mut rng = Rng::new(7);
    for (pairs, experts, foreign) in [
        (0, 4, false),
        (1, 1, false),
        (64, 8, false),
        (999, 64, true),
        (4096, 3, true),
    ] {
        let ids: Vec<i64> = (0..pairs)
            .map(|_| {
                let span = experts as u64 + if foreign { 3 } else { 0 };
                (rng.next_u64() % span) as i64 - i64::from(foreign)
            })
            .collect();
        let key = |id: i64| {
            if (0..experts as i64).contains(&id) {
                id
            } else {
                experts as i64
            }
        };
        let mut expected: Vec<i64> = (0..pairs as i64).collect();
        expected.sort_by_key(|&p| key(ids[p as usize]));
        let (mut perm, mut inv) = (vec![-1i64; pairs], vec![-1i64; pairs]);
        let mut offsets = vec![-1i32; experts];
        sort(&ids, experts, &mut perm, &mut inv, &mut offsets);
        assert_eq!(perm, expected);
        for (s, &p) in perm.iter().enumerate() {
            assert_eq!(inv[p as usize], s as i64);
        }
        for (e, &end) in offsets.iter().enumerate() {
            let count = ids.iter().filter(|&&id| key(id) <= e as i64).count();
            assert_eq!(end as usize, count, "expert {e}");
        }
    }
}
