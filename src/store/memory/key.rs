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
        self.as_bytes() == id
    }
}
