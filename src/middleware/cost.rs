//! What a request costs: [`Cost`], and reading what the upstream says a call cost.

use std::num::NonZeroU32;

/// What one request costs, in tokens, as a request extension, in place of its route's
/// [`cost`](super::Route::cost): `client.post(url).with_extension(Cost::new(n))` for a batch
/// of `n` items that the API counts as `n` requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cost(NonZeroU32);

impl Cost {
    /// A cost of `tokens`.
    pub const fn new(tokens: NonZeroU32) -> Self {
        Self(tokens)
    }

    /// The tokens.
    pub const fn tokens(&self) -> u32 {
        self.0.get()
    }
}
