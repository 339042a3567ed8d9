//! Gated linear units over contiguous buffers: `y = act(gate) * up` and its backward
//! `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)`, with act SiLU (SwiGLU) or GELU
//! (GeGLU, tanh-approximated or exact). Arithmetic in `T::Acc`, each output rounded once.
//!
//! The vector kernels compute `f32` activations with [`crate::vmath`] (`e^x` within 1 ulp, the
//! normal CDF within 3.2 ulp) and `f64` ones lane by lane with libm's `exp`/`erfc`, as the
//! scalar path ([`GluMath`]) does for element types without vector kernels. bf16 and f16
//! outputs get shorter `f32` math whose error is far below their rounding
//! (`activation::math_for`).
//!
//! Here: the calls, their scalar path, and the dispatch to the vector kernels; `activation`: the
//! activations and their derivatives, scalar and lane-wise; `lanes`: the vector loops;
//! `packed`: the same calls over rows that hold `[gate | up]` side by side (a fused gate-and-up
//! projection's output, as mixture-of-experts layers make it).

mod activation;
mod lanes;
mod packed;

use self::activation::eval;
pub use self::activation::GluMath;
use self::lanes::{backward_in_place_lanes, backward_lanes, forward_lanes};
pub use self::packed::{backward_packed, backward_packed_in_place, forward_packed};
use crate::blocks;
use crate::float::Float;
use crate::isa::Isa;
use crate::parallel::Parallel;
use crate::simd::portable::Portable;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::{Avx2, Avx512};
use crate::tables::select_table;

/// The activation applied to the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    /// `x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`.
    GeluErf,
}

/// Elements per work item handed to the parallel-for.
const CHUNK: usize = 1 << 13;

fn check_lengths(n: usize, lens: &[(&str, usize)]) {
    for (name, len) in lens {
        assert_eq!(*len, n, "glu: {name} has {len} elements, expected {n}");
    }
}

/// `y = act(gate) * up`.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn forward<T: Float>(act: Activation, gate: &[T], up: &[T], y: &mut [T], par: &dyn Parallel)
where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(n, &[("up", up.len()), ("y", y.len())]);
    let kernel = kernels::<T>();
    let chunks: Vec<&mut [T]> = y.chunks_mut(CHUNK).collect();
    blocks::for_each(par, chunks, CHUNK, |i, y| {
        let at = i * CHUNK..i * CHUNK + y.len();
        forward_span(kernel, act, &gate[at.clone()], &up[at], y);
    });
}

/// `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)`.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn backward<T: Float>(
    act: Activation,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(
        n,
        &[
            ("up", up.len()),
            ("dy", dy.len()),
            ("dgate", dgate.len()),
            ("dup", dup.len()),
        ],
    );
    let kernel = kernels::<T>();
    let chunks: Vec<(&mut [T], &mut [T])> =
        dgate.chunks_mut(CHUNK).zip(dup.chunks_mut(CHUNK)).collect();
    blocks::for_each(par, chunks, CHUNK, |i, (dg, du)| {
        let at = i * CHUNK..i * CHUNK + dg.len();
        let (gate, up, dy) = (&gate[at.clone()], &up[at.clone()], &dy[at]);
        backward_span(kernel, act, gate, up, dy, dg, du);
    });
}

/// [`backward`] writing `dgate` over `gate` and `dup` over `up` (no output buffers: what the
/// `inplace_backward` option of the Python ops asks for). Each element of `gate`, `up` and `dy`
/// is read before the same element is written.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn backward_in_place<T: Float>(
    act: Activation,
    gate: &mut [T],
    up: &mut [T],
    dy: &[T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(n, &[("up", up.len()), ("dy", dy.len())]);
    let kernel = kernels::<T>();
    let chunks: Vec<(&mut [T], &mut [T])> =
        gate.chunks_mut(CHUNK).zip(up.chunks_mut(CHUNK)).collect();
    blocks::for_each(par, chunks, CHUNK, |i, (g, u)| {
        let dy = &dy[i * CHUNK..i * CHUNK + g.len()];
        backward_in_place_span(kernel, act, g, u, dy);
    });
}

/// [`forward`] over one span of equal-length slices, on the calling thread: the vector kernel
/// when `T` has one, else element by element.
fn forward_span<T: Float>(
    kernel: Option<Kernels<T>>,
    act: Activation,
    gate: &[T],
    up: &[T],
    y: &mut [T],
) where
    T::Acc: GluMath,
{
    match kernel {
        Some(kernel) => (kernel.forward)(act, gate, up, y),
        None => {
            for (y, (&g, &u)) in y.iter_mut().zip(gate.iter().zip(up)) {
                let (f, _) = eval(act, g.to_acc());
                *y = T::from_acc(f * u.to_acc());
            }
        }
    }
}

/// [`backward`] over one span, on the calling thread (as [`forward_span`]).
fn backward_span<T: Float>(
    kernel: Option<Kernels<T>>,
    act: Activation,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) where
    T::Acc: GluMath,
{
    match kernel {
        Some(kernel) => (kernel.backward)(act, gate, up, dy, dgate, dup),
        None => {
            let inputs = gate.iter().zip(up).zip(dy);
            for ((dg, du), ((&g, &u), &d)) in dgate.iter_mut().zip(dup.iter_mut()).zip(inputs) {
                let (f, df) = eval(act, g.to_acc());
                let d = d.to_acc();
                *dg = T::from_acc(d * u.to_acc() * df);
                *du = T::from_acc(d * f);
            }
        }
    }
}

/// [`backward_in_place`] over one span, on the calling thread (as [`forward_span`]).
fn backward_in_place_span<T: Float>(
    kernel: Option<Kernels<T>>,
    act: Activation,
    gate: &mut [T],
    up: &mut [T],
    dy: &[T],
) where
    T::Acc: GluMath,
{
    match kernel {
        Some(kernel) => (kernel.backward_in_place)(act, gate, up, dy),
        None => {
            for ((g, u), &d) in gate.iter_mut().zip(up.iter_mut()).zip(dy) {
                let (f, df) = eval(act, g.to_acc());
                let d = d.to_acc();
                (*g, *u) = (T::from_acc(d * u.to_acc() * df), T::from_acc(d * f));
            }
        }
    }
}

/// `(act, gate, up, dy, dgate, dup)`: [`backward_lanes`] over one chunk.
type BackwardFn<T> = fn(Activation, &[T], &[T], &[T], &mut [T], &mut [T]);

/// GLU's vector kernels for element type `T`, compiled for one instruction set.
struct Kernels<T: Float> {
    /// [`forward_lanes`] over one chunk.
    forward: fn(Activation, &[T], &[T], &mut [T]),
    /// [`backward_lanes`] over one chunk.
    backward: BackwardFn<T>,
    /// [`backward_in_place_lanes`] over one chunk: `(act, gate, up, dy)`.
    backward_in_place: fn(Activation, &mut [T], &mut [T], &[T]),
}

impl<T: Float> Clone for Kernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for Kernels<T> {}

/// The vector kernels for `T` and [`Isa::current`]; `None` for element types other than
/// `f32`, `f64`, `bf16` and `f16` (their callers then compute one element at a time).
fn kernels<T: Float>() -> Option<Kernels<T>> {
    let isa = Isa::current();
    select_table!(|N| match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Kernels::<N> {
            forward: |act, g, u, y| x86::avx512_bf16::forward(Avx512::get(), act, g, u, y),
            backward: |act, g, u, dy, dg, du| {
                x86::avx512_bf16::backward(Avx512::get(), act, g, u, dy, dg, du)
            },
            backward_in_place: |act, g, u, dy| {
                x86::avx512_bf16::backward_in_place(Avx512::get(), act, g, u, dy)
            },
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Kernels::<N> {
            forward: |act, g, u, y| x86::avx2::forward(Avx2::get(), act, g, u, y),
            backward: |act, g, u, dy, dg, du| {
                x86::avx2::backward(Avx2::get(), act, g, u, dy, dg, du)
            },
            backward_in_place: |act, g, u, dy| {
                x86::avx2::backward_in_place(Avx2::get(), act, g, u, dy)
            },
        },
        _ => Kernels::<N> {
            forward: |act, g, u, y| forward_lanes(Portable, act, g, u, y),
            backward: |act, g, u, dy, dg, du| backward_lanes(Portable, act, g, u, dy, dg, du),
            backward_in_place: |act, g, u, dy| backward_in_place_lanes(Portable, act, g, u, dy),
        },
    })
}

/// GLU's kernels compiled for each x86 token; on AVX-512 CPUs with AVX512-BF16 once more with
/// it, so that bf16 outputs are rounded by `vcvtneps2bf16` (2 instructions a vector instead of
/// 10; the other element types compile to the same code as without it).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::activation::ActLanes;
    use super::lanes::{backward_in_place_lanes, backward_lanes, forward_lanes};
    use super::Activation;
    use crate::simd::{Lanes, Simd};

    crate::vectorize::x86_entry_points! { [avx2, avx512, avx512_bf16]
        /// [`forward_lanes`] compiled for the token `S`.
        fn forward<T>(s: S, act: Activation, gate: &[T], up: &[T], y: &mut [T])
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { forward_lanes(s, act, gate, up, y) }

        /// [`backward_lanes`] compiled for the token `S`.
        fn backward<T>(
            s: S,
            act: Activation,
            gate: &[T],
            up: &[T],
            dy: &[T],
            dgate: &mut [T],
            dup: &mut [T]
        )
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { backward_lanes(s, act, gate, up, dy, dgate, dup) }

        /// [`backward_in_place_lanes`] compiled for the token `S`.
        fn backward_in_place<T>(s: S, act: Activation, gate: &mut [T], up: &mut [T], dy: &[T])
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { backward_in_place_lanes(s, act, gate, up, dy) }
    }
}
