//! The float64 CPU reference of RMSNorm's forward and backward.

use super::*;

pub(super) struct FwdRef {
    pub(super) y: Vec<f64>,
    pub(super) rstd: Vec<f64>,
}

pub(super) fn forward_ref(
    x: &[f64],
    w: Option<&[f64]>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> FwdRef {
    let mut y = vec![0.0; rows * cols];
    let mut rstd = vec![0.0; rows];
    let chunk = rows.div_ceil(threads()).max(1);
    std::thread::scope(|s| {
        for (ci, (yc, rc)) in y
            .chunks_mut(chunk * cols)
            .zip(rstd.chunks_mut(chunk))
            .enumerate()
        {
            s.spawn(move || {
                for (i, r_out) in rc.iter_mut().enumerate() {
                    let row = ci * chunk + i;
                    let xr = &x[row * cols..(row + 1) * cols];
                    let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64;
                    let r = 1.0 / (ms + eps).sqrt();
                    *r_out = r;
                    for (j, out) in yc[i * cols..(i + 1) * cols].iter_mut().enumerate() {
                        *out = xr[j] * r * w.map_or(1.0, |w| w[j]);
                    }
                }
            });
        }
    });
    FwdRef { y, rstd }
}

pub(super) struct BwdRef {
    pub(super) dx: Vec<f64>,
    pub(super) dw: Vec<f64>,
    /// ||rstd * g||: the scale of dx's terms (see rel_err).
    pub(super) dx_scale: f64,
    /// ||sum over rows of |dy * xhat||| / sqrt(rows): the size a sum of `rows` random-sign
    /// terms has, so that an unluckily cancelling column (cols == 1) is not misjudged.
    pub(super) dw_scale: f64,
}

pub(super) fn backward_ref(
    dy: &[f64],
    x: &[f64],
    rstd: &[f64],
    w: Option<&[f64]>,
    rows: usize,
    cols: usize,
) -> BwdRef {
    let mut dx = vec![0.0; rows * cols];
    let chunk = rows.div_ceil(threads()).max(1);
    let mut partials: Vec<(Vec<f64>, Vec<f64>, f64)> = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = dx
            .chunks_mut(chunk * cols)
            .enumerate()
            .map(|(ci, dxc)| {
                s.spawn(move || {
                    let mut dw = vec![0.0; cols];
                    let mut dw_abs = vec![0.0; cols];
                    let mut scale2 = 0.0;
                    for i in 0..dxc.len() / cols {
                        let row = ci * chunk + i;
                        let (xr, gr) = (&x[row * cols..][..cols], &dy[row * cols..][..cols]);
                        let r = rstd[row];
                        let g = |j: usize| gr[j] * w.map_or(1.0, |w| w[j]);
                        let dot: f64 = (0..cols).map(|j| g(j) * xr[j] * r).sum();
                        let c = dot / cols as f64;
                        for j in 0..cols {
                            let xh = xr[j] * r;
                            dxc[i * cols + j] = (g(j) - xh * c) * r;
                            dw[j] += gr[j] * xh;
                            dw_abs[j] += (gr[j] * xh).abs();
                            scale2 += (g(j) * r) * (g(j) * r);
                        }
                    }
                    (dw, dw_abs, scale2)
                })
            })
            .collect();
        partials = handles.into_iter().map(|h| h.join().unwrap()).collect();
    });
    let mut dw = vec![0.0; cols];
    let mut dw_abs = vec![0.0; cols];
    let mut scale2 = 0.0;
    for (p, pa, s2) in &partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
        for (a, b) in dw_abs.iter_mut().zip(pa) {
            *a += b;
        }
        scale2 += s2;
    }
    let dw_scale = dw_abs.iter().map(|v| v * v).sum::<f64>().sqrt() / (rows as f64).sqrt();
    BwdRef {
        dx,
        dw,
        dx_scale: scale2.sqrt(),
        dw_scale,
    }
}
