//! The `Parallel` implementations keep their contract: disjoint ranges covering `0..n`, each at
//! least `grain` long unless `n` is smaller.

use std::ops::Range;
use std::sync::Mutex;

use graft_kernels::{Parallel, Serial, Threads};

fn ranges(par: &dyn Parallel, n: usize, grain: usize) -> Vec<Range<usize>> {
    let seen = Mutex::new(Vec::new());
    par.for_range(n, grain, &|r| seen.lock().unwrap().push(r));
    let mut seen = seen.into_inner().unwrap();
    seen.sort_by_key(|r| r.start);
    seen
}

#[test]
fn ranges_are_disjoint_cover_and_respect_grain() {
    let pars: [(&str, &dyn Parallel); 6] = [
        ("Serial", &Serial),
        ("Threads(0)", &Threads(0)),
        ("Threads(1)", &Threads(1)),
        ("Threads(2)", &Threads(2)),
        ("Threads(3)", &Threads(3)),
        ("Threads(8)", &Threads(8)),
    ];
    for (name, par) in pars {
        for n in [0, 1, 2, 3, 7, 10, 64, 100, 1000] {
            for grain in [0, 1, 2, 3, 16, 64, 5000] {
                let seen = ranges(par, n, grain);
                let ctx = format!("{name} n={n} grain={grain}: {seen:?}");
                let mut next = 0;
                for r in &seen {
                    assert_eq!(r.start, next, "gap or overlap ({ctx})");
                    assert!(r.len() >= grain.min(n), "range under grain ({ctx})");
                    next = r.end;
                }
                assert_eq!(next, n, "not covered ({ctx})");
            }
        }
    }
}

#[test]
fn threads_split_evenly() {
    let seen = ranges(&Threads(2), 1000, 1);
    assert_eq!(seen, vec![0..500, 500..1000]);
    let seen = ranges(&Threads(3), 10, 3);
    assert_eq!(seen, vec![0..3, 3..6, 6..10]);
    // Not enough work for more than one share of `grain`.
    assert_eq!(ranges(&Threads(8), 10, 6), vec![0..10]);
}
