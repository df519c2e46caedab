//! [`Ticket`]: a turn booked in a shared bucket, held by a job queue as plain data.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use crate::error::TicketError;
use crate::store::Source;
use crate::{BucketKey, Reservation};

/// A turn booked in a route's shared bucket for a request that a job queue sends later, from
/// [`RateLimitMiddleware::reserve`](super::RateLimitMiddleware::reserve).
///
/// A job runner with a few worker slots must not have them all asleep on "1 per minute"
/// buckets. Instead of sending through the middleware, which waits in the slot, a job books
/// its turn, goes back on the queue until [`ready_at`](Self::ready_at), frees its slot, and at
/// its time sends its request with the ticket as an extension
/// (`client.get(url).with_extension(ticket)`): the middleware sends it without taking another
/// token. Sent early, it is refused locally with a [`RateLimited`](crate::RateLimited) saying
/// how long is left; a job dropped for good gives its tokens back with
/// [`cancel`](super::RateLimitMiddleware::cancel).
///
/// A ticket is plain data: `Display` writes it as one line of text, `FromStr` reads it back
/// (and with the `serde` feature it serializes as that text), so it survives a restart of the
/// process in a job's payload. The text holds the bucket key as the store does (an account
/// name escaped, a secret account hashed or keyed, never in clear), the slot and the cost:
///
/// ```text
/// burstgate-ticket:1:<slot, ms since the Unix epoch>:<cost>:<source>:<bucket>:<key>
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Ticket {
    pub(super) key: BucketKey,
    pub(super) reservation: Reservation,
}

/// The first field of a ticket's text, with the version of its layout.
const TAG: &str = "burstgate-ticket:1";

impl Ticket {
    /// When the request may go: its slot in the bucket's queue.
    pub fn ready_at(&self) -> SystemTime {
        self.reservation.ready_at()
    }

    /// How long from `now` until [`ready_at`](Self::ready_at); zero once it has come.
    pub fn ready_in(&self, now: SystemTime) -> Duration {
        self.ready_at()
            .duration_since(now)
            .unwrap_or(Duration::ZERO)
    }

    /// The tokens booked.
    pub fn cost(&self) -> u32 {
        self.reservation.cost()
    }

    /// The bucket the turn is in.
    pub fn bucket(&self) -> &str {
        self.key.bucket()
    }
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.reservation.source() {
            Source::Store => 's',
            Source::Local => 'l',
            Source::Nothing => 'n',
        };
        write!(
            f,
            "{TAG}:{}:{}:{source}:{}",
            self.reservation.ready_at_ms(),
            self.reservation.cost(),
            self.key.as_str()
        )
    }
}

impl FromStr for Ticket {
    type Err = TicketError;

    fn from_str(s: &str) -> Result<Self, TicketError> {
        let rest = s.strip_prefix(TAG).and_then(|r| r.strip_prefix(':'));
        let mut fields = rest.ok_or(TicketError::Malformed)?.splitn(4, ':');
        let mut next = || fields.next().ok_or(TicketError::Malformed);
        let number = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().ok())
                .flatten()
                .ok_or(TicketError::Malformed)
        };
        let ready_at_ms = number(next()?)?;
        let cost = u32::try_from(number(next()?)?).map_err(|_| TicketError::Malformed)?;
        let source = match next()? {
            "s" => Source::Store,
            "l" => Source::Local,
            "n" => Source::Nothing,
            _ => return Err(TicketError::Malformed),
        };
        let key = BucketKey::from_id(next()?).ok_or(TicketError::Malformed)?;
        if cost == 0 {
            return Err(TicketError::Malformed);
        }
        Ok(Self {
            key,
            reservation: Reservation::from_parts(cost, ready_at_ms, source),
        })
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("bucket", &self.key.bucket())
            .field("key", &self.key.fingerprint())
            .field("cost", &self.reservation.cost())
            .field("ready_at_ms", &self.reservation.ready_at_ms())
            .finish()
    }
}

crate::text::serde_as_text!(Ticket, "a burstgate ticket");

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(key: &str, cost: u32, ready_at_ms: u64) -> Ticket {
        Ticket {
            key: BucketKey::new("orders", key).expect("a key"),
            reservation: Reservation::from_parts(cost, ready_at_ms, Source::Store),
        }
    }

    #[test]
    fn a_ticket_reads_back_from_its_text() {
        let t = ticket("seller:42", 2, 1_796_000_000_123);
        let text = t.to_string();
        assert_eq!(
            text,
            "burstgate-ticket:1:1796000000123:2:s:orders:seller%3A42"
        );
        assert_eq!(text.parse::<Ticket>(), Ok(t.clone()));
        assert_eq!(t.cost(), 2);
        assert_eq!(t.bucket(), "orders");
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_000_000_000);
        assert_eq!(t.ready_in(at), Duration::from_millis(123));
        assert_eq!(
            t.ready_in(t.ready_at() + Duration::from_secs(1)),
            Duration::ZERO
        );
        // The key's own colons stay in the last field.
        assert!(!format!("{t:?}").contains("seller"), "{t:?}");
    }

    #[test]
    fn anything_else_is_malformed() {
        for bad in [
            "",
            "burstgate-ticket:1",
            "burstgate-ticket:2:1:1:s:orders:k",
            "burstgate-ticket:1:x:1:s:orders:k",
            "burstgate-ticket:1:1:0:s:orders:k",
            "burstgate-ticket:1:1:-1:s:orders:k",
            "burstgate-ticket:1:1:4294967296:s:orders:k",
            "burstgate-ticket:1:1:1:x:orders:k",
            "burstgate-ticket:1:1:1:s:orders",
            "burstgate-ticket:1:1:1:s:bad name:k",
            "burstgate-ticket:1:1:1:s:orders:%41",
            "burstgate-ticket:1:+1:1:s:orders:k",
        ] {
            assert_eq!(
                bad.parse::<Ticket>(),
                Err(TicketError::Malformed),
                "{bad:?}"
            );
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_writes_and_reads_the_text() {
        let t = ticket("seller-1", 1, 5);
        let json = serde_json::to_string(&t).expect("serializes");
        assert_eq!(json, "\"burstgate-ticket:1:5:1:s:orders:seller-1\"");
        assert_eq!(serde_json::from_str::<Ticket>(&json).expect("reads"), t);
    }
}
