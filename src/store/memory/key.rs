//! A bucket's key as a shard holds it: inline when short, shared on the heap when long.

use std::sync::Arc;

/// Longer keys than this live on the heap. 30 bytes fill the slot's line (with the lock, the
/// length, the enum's tag and the 24 bytes of bucket), and cover most
/// `bucket:key` forms: account names, IPv4 addresses, short API key ids. Hashed keys (64 hex
/// digits) do not fit.
const INLINE_LEN: usize = 30;

/// A key as the table holds it: inline when short, which spares a decision the pointer chase
/// (and a new key the allocation). A long key is shared, not owned: a rebuild copies every
/// bucket it keeps into the new table while the old one lives on for threads still looking at
/// it, and a copied `Box` would cost an allocation and a free per bucket per rebuild.
#[derive(Clone)]
pub(super) enum Key {
    Inline { len: u8, bytes: [u8; INLINE_LEN] },
    Heap(Arc<[u8]>),
}

impl Key {
    pub(super) fn new(id: &[u8]) -> Self {
        match u8::try_from(id.len()) {
            Ok(len) if id.len() <= INLINE_LEN => {
                let mut bytes = [0; INLINE_LEN];
                bytes[..id.len()].copy_from_slice(id);
                Key::Inline { len, bytes }
            }
            _ => Key::Heap(id.into()),
        }
    }

    #[inline]
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            // `new` only makes inline keys that fit, so the range is in bounds.
            Key::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Key::Heap(id) => id,
        }
    }

    #[inline]
    pub(super) fn is(&self, id: &[u8]) -> bool {
        same(self.as_bytes(), id)
    }
}

/// `a == b`, without the call into the C library's `memcmp` that slice equality makes: a key
/// is compared on every decision, and the usual one is 8 to 32 bytes, which two loads from each
/// end cover (overlapping in the middle).
#[inline]
fn same(a: &[u8], b: &[u8]) -> bool {
    fn ends<const N: usize>(a: &[u8], b: &[u8]) -> bool {
        a.first_chunk::<N>() == b.first_chunk::<N>() && a.last_chunk::<N>() == b.last_chunk::<N>()
    }
    if a.len() != b.len() {
        return false;
    }
    match a.len() {
        16..=32 => ends::<16>(a, b),
        8..16 => ends::<8>(a, b),
        4..8 => ends::<4>(a, b),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length the chunked comparison takes a path for, and a difference at every byte:
    /// equal only when the bytes are.
    #[test]
    fn keys_are_the_same_only_when_every_byte_is() {
        for len in 0..=40_usize {
            let a: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            let key = Key::new(&a);
            assert!(key.is(&a), "{len} bytes");
            for at in 0..len {
                let mut b = a.clone();
                b[at] ^= 1;
                assert!(!key.is(&b), "{len} bytes, differing at {at}");
            }
            assert!(!key.is(&a[..len.saturating_sub(1)]) || len == 0);
            let mut longer = a.clone();
            longer.push(b'z');
            assert!(!key.is(&longer), "{len} bytes and one more");
        }
    }
}
