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

/// A cost a field reports: a count, a fraction rounded up (a call that cost 2.5 tokens owes 3).
pub(super) fn cost_count(value: &str) -> Option<u64> {
    let value = value.trim();
    let whole = super::follow::count(value)?;
    let fraction = value.split_once('.').map_or("", |(_, f)| f);
    Some(if fraction.bytes().any(|b| b != b'0') {
        whole.saturating_add(1)
    } else {
        whole
    })
}

#[cfg(test)]
mod tests {
    use super::cost_count;

    #[test]
    fn a_reported_cost_is_a_count_and_a_fraction_rounds_up() {
        for (text, cost) in [
            ("3", 3),
            (" 0 ", 0),
            ("2.5", 3),
            ("2.01", 3),
            ("2.000", 2),
            ("2.", 2),
            ("99999999999999999999999", u64::MAX),
            ("99999999999999999999999.5", u64::MAX),
        ] {
            assert_eq!(cost_count(text), Some(cost), "{text:?}");
        }
        for bad in ["", "-1", "+1", ".5", "1e3", "two", "1.x", "1,2", "1 2"] {
            assert_eq!(cost_count(bad), None, "{bad:?}");
        }
    }
}
