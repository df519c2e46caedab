//! How the sharded tables (`MemoryStore`'s shards, the Redis store's deny cache) hash a key and
//! pick its shard, so that both spread keys the same, well-tested way.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use foldhash::SharedSeed;
use foldhash::fast::SeedableRandomState;

/// The hash of a bucket key's id, `<bucket>:<key>`, with the process's hasher: what a
/// `BucketKey` carries from the moment it is made (`BucketKey::id_hash`), so that a store
/// deciding on a key made once hashes nothing, and what `MemoryStore` and the deny cache find
/// their entries by. One hasher for the process, not one per store, since the key does not know
/// which store it will meet; its seeds come from the operating system's random source
/// ([`process_hasher`]).
///
/// The name and the key are hashed as two parts ([`key_hash_parts`]), split at the id's first
/// `:` (a bucket name holds none), so that a key can be hashed from the caller's own bytes while
/// the id is still being written from them: read back from the id just written, the hash would
/// wait for those writes to reach memory.
pub(crate) fn key_hash(id: &[u8]) -> u64 {
    hash_with(process_hasher(), id)
}

/// [`key_hash`] of the id `<bucket>:<key>`.
#[inline]
pub(crate) fn key_hash_parts(bucket: &[u8], key: &[u8]) -> u64 {
    parts_with(process_hasher(), bucket, key)
}

/// foldhash, seeded once per process from the operating system's random source (both of its
/// seeds: foldhash's own default draws its shared seed from addresses alone when built without
/// its `std` feature, as here), so that a caller choosing keys cannot know which collide.
fn process_hasher() -> &'static SeedableRandomState {
    static HASHER: OnceLock<SeedableRandomState> = OnceLock::new();
    static SHARED: OnceLock<SharedSeed> = OnceLock::new();
    HASHER.get_or_init(|| {
        let [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, ..] = crate::key::random_bytes();
        let shared = SHARED
            .get_or_init(|| SharedSeed::from_u64(u64::from_le_bytes([a, b, c, d, e, f, g, h])));
        SeedableRandomState::with_seed(u64::from_le_bytes([i, j, k, l, m, n, o, p]), shared)
    })
}

/// [`key_hash`] with `hasher`.
fn hash_with(hasher: &SeedableRandomState, id: &[u8]) -> u64 {
    match id.iter().position(|&b| b == b':') {
        Some(colon) => parts_with(hasher, &id[..colon], &id[colon + 1..]),
        // Not an id a `BucketKey` holds; hashed all the same.
        None => parts_with(hasher, id, &[]),
    }
}

/// [`key_hash_parts`] with `hasher`.
#[inline]
fn parts_with(hasher: &SeedableRandomState, bucket: &[u8], key: &[u8]) -> u64 {
    let mut h = hasher.build_hasher();
    h.write(bucket);
    h.write(key);
    h.finish()
}

/// [`key_hash`] with a hasher of the given seeds, for tests that try the hash's spread over many
/// seeds.
#[cfg(test)]
pub(crate) fn key_hash_seeded(per_hasher: u64, shared: u64) -> impl Fn(&[u8]) -> u64 {
    let shared: &'static SharedSeed = Box::leak(Box::new(SharedSeed::from_u64(shared)));
    let hasher = SeedableRandomState::with_seed(per_hasher, shared);
    move |id| hash_with(&hasher, id)
}

/// The shard, of `count`, for a key's `hash`: the top bits of the hash times 2^64 / φ
/// (Fibonacci hashing), which depend on every bit of the hash. The tables inside a shard use the
/// hash's low bits (and `MemoryStore`'s new-keys table its top seven); the bits in between, taken
/// as they are, spread keys that differ in a digit or two (`client-17`, `client-18`) unevenly for
/// some seeds of the hasher (docs/HISTORY.md says how unevenly).
///
/// `count` must be a power of two; one shard is index 0.
pub(crate) fn index(hash: u64, count: usize) -> usize {
    debug_assert!(count.is_power_of_two());
    let mixed = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // The top log2(count) bits: a shift by 64 minus that, in two steps so that one shard (a
    // shift of 64, which Rust refuses) shifts every bit out. Each step is below 64.
    ((mixed >> 1) >> (63 - count.trailing_zeros())) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that differ in their last digits, the usual shape of account and client ids, spread
    /// within a few percent of the mean over every shard count the stores use.
    #[test]
    fn sequential_keys_spread_evenly() {
        for count in [2, 16, 256, 4096] {
            let mut per_shard = vec![0u32; count];
            let keys = count * 200;
            for i in 0..keys {
                let key = format!("client-{i}");
                per_shard[index(key_hash(key.as_bytes()), count)] += 1;
            }
            let (min, max) = (
                per_shard.iter().copied().min().unwrap_or(0),
                per_shard.iter().copied().max().unwrap_or(0),
            );
            // A fair spread of 200 per shard: within a binomial's few standard deviations.
            assert!(min >= 120 && max <= 290, "{count} shards: {min}..={max}");
        }
    }

    /// One shard takes every key; more take the hash's top bits, the same as one shift would.
    #[test]
    fn one_shard_is_index_zero_and_more_take_the_top_bits() {
        for hash in [0, 1, u64::MAX, 0x8000_0000_0000_0000, 0x1234_5678_9ABC_DEF0] {
            assert_eq!(index(hash, 1), 0);
            let mixed = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for bits in 1..=16 {
                assert_eq!(index(hash, 1 << bits), (mixed >> (64 - bits)) as usize);
            }
        }
    }
}
