//! A key's text as a `BucketKey` holds it: inside the value when short, on the heap when long,
//! and how it is written from a bucket name and a caller's key.

use super::{BYTES, MAX_BUCKET_LEN, MAX_ESCAPED_KEY_LEN, PLAIN, plain};

/// Ids up to this many bytes live inside the `BucketKey` (64 bytes in all), so that a server
/// that builds a key per request allocates nothing for it. That covers the usual forms: an
/// account, an IPv4 address, a UUID under a short bucket name. A hashed key (the bucket name and
/// 65 bytes more) and a long escaped one go to the heap.
const INLINE_LEN: usize = 45;

/// The longest id: a bucket name, `:` and an escaped key.
const MAX_LEN: usize = MAX_BUCKET_LEN + 1 + MAX_ESCAPED_KEY_LEN;

const UPPER_HEX: &[u8; 16] = b"0123456789ABCDEF";
const LOWER_HEX: &[u8; 16] = b"0123456789abcdef";

/// `<bucket>:<escaped or hashed key>`, and where the bucket name ends.
///
/// Only ASCII is ever written into an id, so its bytes are always its text. Equality and
/// hashing go by those bytes (`as_bytes`): an inline id's bytes past its length mean nothing.
#[derive(Clone)]
pub(super) enum Id {
    Inline {
        bucket_len: u8,
        len: u8,
        bytes: [u8; INLINE_LEN],
    },
    Heap {
        bucket_len: u8,
        id: Box<str>,
    },
}

impl Id {
    /// `id`, whose bucket name is its first `bucket_len` bytes (at most 64).
    pub(super) fn of(id: &str, bucket_len: usize) -> Self {
        let bucket_len = bucket_len as u8;
        match u8::try_from(id.len()) {
            Ok(len) if id.len() <= INLINE_LEN => {
                let mut bytes = [0; INLINE_LEN];
                bytes[..id.len()].copy_from_slice(id.as_bytes());
                Id::Inline {
                    bucket_len,
                    len,
                    bytes,
                }
            }
            _ => Id::Heap {
                bucket_len,
                id: id.into(),
            },
        }
    }

    /// `<bucket>:<key>` for a checked bucket name and a key that needs no escape, if the two
    /// fit inline: the usual key, written without the long path's stack buffer.
    #[inline]
    pub(super) fn unescaped(bucket: &str, key: &[u8]) -> Option<Self> {
        let len = bucket.len() + 1 + key.len();
        if len > INLINE_LEN {
            return None;
        }
        let mut bytes = [0; INLINE_LEN];
        let (name, rest) = bytes.split_at_mut(bucket.len());
        copy_short(name, bucket.as_bytes());
        let (colon, rest) = rest.split_first_mut()?;
        *colon = b':';
        copy_short(rest, key);
        // Every byte looked at, with no branch per byte: cheaper than stopping at the first to
        // escape, which is rare.
        let all = key
            .iter()
            .fold(PLAIN, |all, &b| all & BYTES[usize::from(b)]);
        (all & PLAIN != 0).then_some(Id::Inline {
            bucket_len: bucket.len() as u8,
            len: len as u8,
            bytes,
        })
    }

    #[inline]
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            // `finish` makes inline ids only of a length that fits.
            Id::Inline { len, bytes, .. } => &bytes[..usize::from(*len)],
            Id::Heap { id, .. } => id.as_bytes(),
        }
    }

    /// The id as text. An inline id's bytes are checked again on each call, which safe code
    /// cannot skip; they are ASCII, so the check never fails and costs a few instructions a
    /// byte.
    pub(super) fn as_str(&self) -> &str {
        self.text(0, usize::MAX)
    }

    /// The bucket name.
    pub(super) fn bucket(&self) -> &str {
        self.text(0, self.bucket_len())
    }

    /// The escaped or hashed key, after the bucket name and `:`.
    pub(super) fn caller(&self) -> &str {
        self.text(self.bucket_len() + 1, usize::MAX)
    }

    /// The id's bytes from `from` up to `to` (or its end) as text, checked, if inline, over
    /// those bytes alone.
    fn text(&self, from: usize, to: usize) -> &str {
        match self {
            Id::Inline { .. } => {
                let bytes = self.as_bytes();
                let part = bytes.get(from..to.min(bytes.len())).unwrap_or_default();
                std::str::from_utf8(part).unwrap_or_default()
            }
            Id::Heap { id, .. } => id.get(from..to.min(id.len())).unwrap_or_default(),
        }
    }

    fn bucket_len(&self) -> usize {
        match self {
            Id::Inline { bucket_len, .. } | Id::Heap { bucket_len, .. } => usize::from(*bucket_len),
        }
    }
}

/// Copies `from` to the start of `to`, which is at least as long. A bucket name and a key are a
/// few bytes each: two loads from each end cover 4 to 32 bytes without the call into the C
/// library's `memcpy` that `copy_from_slice` makes.
#[inline]
fn copy_short(to: &mut [u8], from: &[u8]) {
    fn ends<const N: usize>(to: &mut [u8], from: &[u8]) -> Option<()> {
        let to = to.get_mut(..from.len())?;
        *to.first_chunk_mut::<N>()? = *from.first_chunk()?;
        *to.last_chunk_mut::<N>()? = *from.last_chunk()?;
        Some(())
    }
    let copied = match from.len() {
        16..=32 => ends::<16>(to, from),
        8..16 => ends::<8>(to, from),
        4..8 => ends::<4>(to, from),
        _ => to.get_mut(..from.len()).map(|to| to.copy_from_slice(from)),
    };
    debug_assert!(
        copied.is_some(),
        "{} bytes copied into {}",
        from.len(),
        to.len()
    );
}

/// An id being written, on the stack: copied into the `Id` once its length is known.
pub(super) struct Text {
    bytes: [u8; MAX_LEN],
    len: usize,
}

impl Text {
    /// `<bucket>:`, for a checked bucket name (at most 64 bytes).
    #[inline]
    pub(super) fn new(bucket: &str) -> Self {
        let mut bytes = [0; MAX_LEN];
        let len = bucket.len() + 1;
        if let Some((colon, to)) = bytes.get_mut(..len).and_then(|b| b.split_last_mut()) {
            to.copy_from_slice(bucket.as_bytes());
            *colon = b':';
        }
        Self { bytes, len }
    }

    /// Appends `key` escaped, and says whether it fit: `false` if the escaped key would be
    /// longer than 128 bytes, and then what was written is to be replaced.
    #[inline]
    pub(super) fn push_escaped(&mut self, key: &[u8]) -> bool {
        let start = self.len;
        // The usual key needs no escape: one pass copies it and checks each byte.
        if key.len() <= MAX_ESCAPED_KEY_LEN
            && let Some(to) = self.bytes.get_mut(start..start + key.len())
        {
            let mut all = PLAIN;
            for (to, &b) in to.iter_mut().zip(key) {
                *to = b;
                all &= BYTES[usize::from(b)];
            }
            if all & PLAIN != 0 {
                self.len += key.len();
                return true;
            }
        }
        let mut at = start;
        for &b in key {
            if plain(b) {
                let Some(to) = self.bytes.get_mut(at) else {
                    return false;
                };
                *to = b;
                at += 1;
            } else {
                let Some([percent, hi, lo]) = self.bytes.get_mut(at..at + 3) else {
                    return false;
                };
                *percent = b'%';
                *hi = UPPER_HEX[usize::from(b >> 4)];
                *lo = UPPER_HEX[usize::from(b & 0xF)];
                at += 3;
            }
            if at - start > MAX_ESCAPED_KEY_LEN {
                return false;
            }
        }
        self.len = at;
        true
    }

    /// Replaces whatever follows `<bucket>:` with `#` and `digest` in lowercase hex.
    pub(super) fn set_digest(&mut self, bucket_len: usize, digest: &[u8; 32]) {
        let start = bucket_len + 1;
        // `#` and 64 digits after a name of at most 64 bytes: within `MAX_LEN`.
        if let Some((hash, hex)) = self
            .bytes
            .get_mut(start..start + 65)
            .and_then(|b| b.split_first_mut())
        {
            *hash = b'#';
            for (pair, &b) in hex.chunks_exact_mut(2).zip(digest) {
                pair[0] = LOWER_HEX[usize::from(b >> 4)];
                pair[1] = LOWER_HEX[usize::from(b & 0xF)];
            }
            self.len = start + 65;
        }
    }

    /// The id written, whose bucket name is its first `bucket_len` bytes (at most 64).
    #[inline]
    pub(super) fn finish(&self, bucket_len: usize) -> Id {
        let bucket_len = bucket_len as u8;
        match (u8::try_from(self.len), self.bytes.first_chunk()) {
            // A copy of a fixed size, cheaper than one of the id's length; what follows the id
            // is never read.
            (Ok(len), Some(bytes)) if self.len <= INLINE_LEN => Id::Inline {
                bucket_len,
                len,
                bytes: *bytes,
            },
            _ => Id::Heap {
                bucket_len,
                // ASCII, so the text as it is, and the check cannot fail.
                id: String::from_utf8_lossy(&self.bytes[..self.len]).into(),
            },
        }
    }
}
