//! How a `MemoryStore` of a given bound is laid out: how many shards, and how many buckets each
//! holds at most. A pure function of the bound and the machine's thread count, so that every
//! bound can be checked on every machine without running on it.
//!
//! The rule and why it honours the bound: docs/DESIGN.md#the-bound.

use crate::store::MAX_TAKES;

/// Shards per thread the machine can run. A shard's lock is taken only for keys new to it, for
/// a thread's first look at a table that has been replaced, and to replace the table, so a few
/// per thread keep those waits rare.
const SHARDS_PER_THREAD: usize = 8;

/// The fewest shards a store with room for them has (see [`MIN_SHARE`]).
const MIN_SHARDS: usize = 16;

/// The most shards a store has (8 MB of them), however large its bound: the shards are made up
/// front, so a bound mistyped by a few orders of magnitude must not allocate gigabytes.
const MAX_SHARDS: usize = 1 << 16;

/// How many buckets a shard should hold at most, which sets the shard count of a large store: a
/// rebuild copies one shard under its lock, and decisions on that shard's keys wait for it, so
/// the shards are kept small enough that a rebuild is short whatever the store's bound.
const MAX_BUCKETS_PER_SHARD: usize = 4_096;

/// The smallest share of the bound a shard gets when there are several: below it, the headroom
/// a shard needs for keys that spread unevenly ([`headroom`]) is too large a part of its share,
/// and a store of one shard, whose bound is exact, is the better trade.
const MIN_SHARE: usize = 1_024;

/// How many standard deviations of a shard's count of keys its headroom covers: eight, so that
/// a shard is full before the store with a chance below 10^-12 (docs/DESIGN.md#the-bound).
const DEVIATIONS: usize = 8;

/// A store's shard count and each shard's most buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// A power of two, from 1 to [`MAX_SHARDS`].
    pub(super) shards: usize,
    /// The most buckets a shard holds; a new key that finds its shard holding this many makes
    /// room first, or is refused.
    pub(super) shard_cap: usize,
}

impl Layout {
    /// The layout of a store bounded at `bound` buckets on a machine that runs `threads` threads
    /// at once (0 reads as 1).
    ///
    /// - Shards: 8 per thread and at least 16, or one per 4,096 buckets of the bound if that is
    ///   more, rounded up to a power of two and at most 2^16; but no more than leave each at
    ///   least 1,024 of the bound (rounded down to a power of two), so a bound below 2,048 is
    ///   one shard.
    /// - Cap: one shard holds the bound itself, and at least [`MAX_TAKES`] so that one request
    ///   on several new buckets always fits; several hold their share of the bound,
    ///   `⌈bound / shards⌉`, and eight times its square root more, rounded up ([`headroom`]).
    ///
    /// Never overflows: every step saturates, and so does [`max_buckets`](Self::max_buckets).
    pub(super) fn of(bound: usize, threads: usize) -> Self {
        let wanted = threads
            .max(1)
            .saturating_mul(SHARDS_PER_THREAD)
            .max(bound.div_ceil(MAX_BUCKETS_PER_SHARD))
            .clamp(MIN_SHARDS, MAX_SHARDS)
            .next_power_of_two();
        let room = match bound / MIN_SHARE {
            0 => 1,
            n => 1 << n.ilog2(),
        };
        let shards = wanted.min(room);
        let shard_cap = if shards == 1 {
            bound.max(MAX_TAKES)
        } else {
            let share = bound.div_ceil(shards);
            share.saturating_add(headroom(share))
        };
        Self { shards, shard_cap }
    }

    /// The most buckets the store holds, saturating at `usize::MAX`.
    pub(super) fn max_buckets(self) -> usize {
        self.shard_cap.saturating_mul(self.shards)
    }
}

/// What a shard of several holds above its `share` of the bound: eight standard deviations of
/// its count of keys when the store holds as many as its bound, `8 × ⌈√share⌉`. Keys spread over
/// the shards as a binomial draw (the hasher is seeded at random per process), whose standard
/// deviation is below `√share`.
fn headroom(share: usize) -> usize {
    let root = share.isqrt();
    let root = if root * root < share { root + 1 } else { root };
    root.saturating_mul(DEVIATIONS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bounds at the edges: the smallest, a few small ones, the default, one past what a
    /// 32-bit count holds (where `usize` allows), and the largest.
    fn bounds() -> Vec<usize> {
        let mut bounds = vec![1, 2, 3, 15, 16, 17, 64, 200, 1_000, 2_047, 2_048, 4_096];
        bounds.extend([10_000, 65_536, 1 << 20, 1_000_003]);
        bounds.extend(usize::try_from(1_u64 << 32).ok());
        bounds.push(usize::MAX);
        bounds
    }

    /// The chance that a shard of a store holding `bound` keys holds `cap` of them or more,
    /// by Bernstein's inequality for a binomial count: `exp(-t² / 2 / (σ² + t/3))` with `t` the
    /// headroom above the mean, and the variance `σ²` below the mean.
    fn overflow_chance(bound: usize, shards: usize, cap: usize) -> f64 {
        let mean = bound as f64 / shards as f64;
        let t = cap as f64 - mean;
        assert!(t > 0.0, "a cap of {cap} at or below the mean {mean}");
        (-(t * t) / 2.0 / (mean + t / 3.0)).exp()
    }

    #[test]
    fn every_layout_honours_its_bound_without_overflowing() {
        for threads in [0, 1, 2, 64, 512, usize::MAX] {
            for bound in bounds() {
                let l = Layout::of(bound, threads);
                let at = format!("bound {bound}, {threads} threads: {l:?}");
                assert!(l.shards.is_power_of_two() && l.shards <= MAX_SHARDS, "{at}");
                assert!(l.shard_cap >= MAX_TAKES, "{at}");
                assert!(l.max_buckets() >= bound, "{at}");
                if l.shards == 1 {
                    // One shard is full exactly at the bound: nothing to spread.
                    assert_eq!(l.shard_cap, bound.max(MAX_TAKES), "{at}");
                    assert!(bound < 2 * MIN_SHARE, "{at}");
                    continue;
                }
                let share = bound.div_ceil(l.shards);
                assert!(share >= MIN_SHARE, "{at}");
                assert_eq!(l.shard_cap, share + headroom(share), "{at}");
                // Full before the store, at its bound: a chance below 10^-12 per new key.
                let chance = overflow_chance(bound, l.shards, l.shard_cap);
                assert!(chance < 1e-12, "{at}: {chance:e}");
                // The headroom costs at most a quarter of the bound, and rounding.
                let slack = l.max_buckets() - bound;
                assert!(slack <= bound / 4 + 10 * l.shards, "{at}: {slack} over");
                // Rebuilds stay short: a share above 4,096 only once the shards run out.
                assert!(
                    share <= MAX_BUCKETS_PER_SHARD || l.shards == MAX_SHARDS,
                    "{at}"
                );
            }
        }
    }

    /// The shard count still grows with the machine while the bound leaves room for it, as it
    /// did before shards were bounded by their share: the default bound keeps its 256 shards of
    /// 4,608 buckets up to 32 threads.
    #[test]
    fn large_bounds_keep_their_shards_per_thread() {
        for threads in [1, 2, 8, 32, 64, 128, 512] {
            for bound in [1 << 20, 1 << 24] {
                let l = Layout::of(bound, threads);
                let room = bound / MIN_SHARE;
                assert_eq!(
                    l.shards,
                    (SHARDS_PER_THREAD * threads)
                        .max(bound / MAX_BUCKETS_PER_SHARD)
                        .next_power_of_two()
                        .min(room),
                    "bound {bound}, {threads} threads"
                );
            }
        }
        for threads in [1, 2, 32] {
            assert_eq!(
                Layout::of(1 << 20, threads),
                Layout {
                    shards: 256,
                    shard_cap: 4_608
                }
            );
        }
    }

    /// The layouts of the bounds and machines the store was seen to fail on, and of the ends:
    /// small bounds are one shard holding the bound itself, on any machine.
    #[test]
    fn the_layouts_of_small_and_extreme_bounds() {
        let of = |bound: usize, threads| {
            let l = Layout::of(bound, threads);
            (l.shards, l.shard_cap, l.max_buckets())
        };
        for threads in [1, 2, 64, 512] {
            assert_eq!(of(1, threads), (1, 16, 16), "{threads} threads");
            assert_eq!(of(2, threads), (1, 16, 16), "{threads} threads");
            assert_eq!(of(3, threads), (1, 16, 16), "{threads} threads");
            assert_eq!(of(64, threads), (1, 64, 64), "{threads} threads");
            assert_eq!(of(1_000, threads), (1, 1_000, 1_000), "{threads} threads");
        }
        assert_eq!(of(1 << 20, 64), (512, 2_416, 1_236_992));
        assert_eq!(of(1 << 20, 512), (1_024, 1_280, 1_310_720));
        if let Ok(bound) = usize::try_from(1_u64 << 32) {
            for threads in [1, 2, 64, 512] {
                assert_eq!(
                    of(bound, threads),
                    (1 << 16, 67_584, 67_584 << 16),
                    "{threads} threads"
                );
            }
        }
        for threads in [1, 2, 64, 512] {
            let l = Layout::of(usize::MAX, threads);
            assert_eq!(l.shards, MAX_SHARDS);
            assert_eq!(l.max_buckets(), usize::MAX, "saturates");
        }
    }
}
