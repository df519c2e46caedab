//! [`Ticket`]: a turn booked in a shared bucket, held by a job queue as plain data.

use std::error::Error as StdError;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use hmac::Mac;

use crate::{BucketKey, KeySecret, Reservation};

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
/// (and with the `serde` feature it serializes as that text), so it can wait in a job's
/// payload. The text holds the bucket key as the store does (an account name escaped, a secret
/// account hashed or keyed, never in clear), the slot, the cost, a random nonce, and an
/// HMAC-SHA256 over all of it:
///
/// ```text
/// burstgate-ticket:1:<slot>:<cost>:<source>:<grace's end>:<nonce>:<mac>:<bucket>:<key>
/// ```
///
/// A request that several routes match books a turn in each of their buckets at once (all or
/// none, at the latest of their times), and its ticket names each after the first, in the
/// routes' order, as `;<slot>:<cost>:<source>:<bucket>:<key>` at the end of the text.
///
/// What the middleware takes on trust, it checks first:
///
/// - The MAC is the middleware's, under a ticket key derived from its
///   [`key_secret`](super::RateLimitMiddleware::key_secret), so a ticket cannot be written or
///   changed outside it ([`TicketError::Forged`](crate::middleware::TicketError::Forged)).
///   Without a key secret, each middleware draws a random one, and its tickets do not outlive
///   it: set the same key secret in every process that sends or cancels another's tickets, and
///   to keep them across a restart. Only a shared store keeps them across a restart: a
///   `MemoryStore` starts empty again, without their bookings, and refuses them as expired.
/// - A ticket goes once. Booking it writes a one-time mark in the store, beside its first
///   bucket, named by its nonce ([`BucketStore::book`](crate::BucketStore::book)); sending or
///   cancelling it spends the mark ([`BucketStore::claim`](crate::BucketStore::claim)), so a
///   job delivered twice sends once
///   ([`TicketError::Spent`](crate::middleware::TicketError::Spent)), in whichever process
///   shares the store (processes on `MemoryStore`s of their own each book and spend in their
///   own). It is spent just before the request goes: a retry of a ticketed request
///   (reqwest-retry in front, after a 5xx) meets `Spent`, and so does a send whose spending the
///   store answered too late to know; book again.
/// - A ticket whose mark the store no longer holds is refused as expired
///   ([`TicketError::Expired`](crate::middleware::TicketError::Expired)), sent or cancelled,
///   and gives nothing back: the store lost it (a `FLUSHALL`, a restart of a Redis without
///   persistence, a failover to a replica that had not received it), and cannot tell whether
///   it went already. What that costs, and the one case where a ticket can still go twice (a
///   Redis that comes back with the mark booked after it was spent), are in the
///   [module docs](super#a-ticket-goes-once).
/// - It goes from its time until one token period per token of its cost after it, an end set
///   and signed when it was booked; later, it would go with the turns booked after it, and is
///   expired ([`TicketError::Expired`](crate::middleware::TicketError::Expired)), its tokens
///   spent. Its mark is kept a second longer, and not past that.
/// - It stands for its own buckets and account, and for a request costing no more than it
///   booked in each: the routes that match the request must draw from exactly its buckets.
#[derive(Clone, PartialEq, Eq)]
pub struct Ticket {
    pub(super) key: BucketKey,
    pub(super) reservation: Reservation,
    /// The turns booked in the buckets of the other routes the request matched, in order.
    pub(super) more: Vec<(BucketKey, Reservation)>,
    /// The end of its grace, in ms since the Unix epoch: set when it was booked, and signed,
    /// so that every process checks it, and keeps its mark, alike.
    pub(super) until_ms: u64,
    pub(super) nonce: [u8; 16],
    pub(super) mac: [u8; 32],
}

/// The first field of a ticket's text, with the version of its layout.
const TAG: &str = "burstgate-ticket:1";

impl Ticket {
    /// When the request may go: its slot in the bucket's queue (the latest of its slots, when
    /// it booked a turn in several buckets).
    pub fn ready_at(&self) -> SystemTime {
        self.buckets()
            .map(|(_, r)| r.ready_at())
            .max()
            .unwrap_or_else(|| self.reservation.ready_at())
    }

    /// How long from `now` until [`ready_at`](Self::ready_at); zero once it has come.
    pub fn ready_in(&self, now: SystemTime) -> Duration {
        self.ready_at()
            .duration_since(now)
            .unwrap_or(Duration::ZERO)
    }

    /// The tokens booked (in the first route's bucket).
    pub fn cost(&self) -> u32 {
        self.reservation.cost()
    }

    /// The bucket the turn is in (the first route's).
    pub fn bucket(&self) -> &str {
        self.key.bucket()
    }

    /// Every bucket the turn is in, with what was booked there, the first route's first.
    pub(super) fn buckets(&self) -> impl Iterator<Item = (&BucketKey, &Reservation)> {
        std::iter::once((&self.key, &self.reservation)).chain(self.more.iter().map(|(k, r)| (k, r)))
    }
}

impl Ticket {
    /// A ticket for `reservation` in `key`'s bucket and the turns in `more`, good for `grace`
    /// after its latest slot, signed under `secret`.
    pub(super) fn signed(
        key: BucketKey,
        reservation: Reservation,
        more: Vec<(BucketKey, Reservation)>,
        grace: Duration,
        secret: &KeySecret,
    ) -> Self {
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let latest = more
            .iter()
            .map(|(_, r)| r.ready_at_ms())
            .fold(reservation.ready_at_ms(), u64::max);
        let mut ticket = Self {
            key,
            reservation,
            more,
            until_ms: latest.saturating_add(grace_ms),
            nonce: nonce(),
            mac: [0; 32],
        };
        let mut mac = secret.signer();
        mac.update(ticket.signed_text().as_bytes());
        ticket.mac = mac.finalize().into_bytes().into();
        ticket
    }

    /// Whether the ticket's MAC is `secret`'s, compared in constant time.
    pub(super) fn verify(&self, secret: &KeySecret) -> bool {
        let mut mac = secret.signer();
        mac.update(self.signed_text().as_bytes());
        mac.verify_slice(&self.mac).is_ok()
    }

    /// When its grace ends: sent later, it is expired.
    pub(super) fn expires_at(&self) -> SystemTime {
        crate::clock::add_or_latest(SystemTime::UNIX_EPOCH, Duration::from_millis(self.until_ms))
    }

    /// The nonce, as the id of the ticket's one-time mark.
    pub(super) fn nonce_hex(&self) -> String {
        hex(&self.nonce)
    }

    /// Everything the MAC covers: the text without the MAC.
    fn signed_text(&self) -> String {
        format!(
            "{TAG}:{}:{}:{}:{}{}",
            self.reservation.to_text(),
            self.until_ms,
            hex(&self.nonce),
            self.key.as_str(),
            self.more_text()
        )
    }

    /// The other buckets' turns, as the text ends with them.
    fn more_text(&self) -> String {
        self.more
            .iter()
            .map(|(key, r)| format!(";{}:{}", r.to_text(), key.as_str()))
            .collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    crate::key::push_hex(&mut out, bytes);
    out
}

/// `N` bytes from exactly `2 × N` lowercase hex digits.
fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let digits = text.as_bytes();
    if digits.len() != 2 * N {
        return None;
    }
    let value = |d: u8| match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        out[i] = value(pair[0])? << 4 | value(pair[1])?;
    }
    Some(out)
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{TAG}:{}:{}:{}:{}:{}{}",
            self.reservation.to_text(),
            self.until_ms,
            hex(&self.nonce),
            hex(&self.mac),
            self.key.as_str(),
            self.more_text()
        )
    }
}

impl FromStr for Ticket {
    type Err = TicketError;

    fn from_str(s: &str) -> Result<Self, TicketError> {
        // Counted before anything is parsed: a long hostile text costs one pass.
        if s.bytes().filter(|&b| b == b';').count() >= crate::MAX_TAKES {
            return Err(TicketError::Malformed);
        }
        let mut turns = s.split(';');
        let first = turns.next().ok_or(TicketError::Malformed)?;
        let rest = first.strip_prefix(TAG).and_then(|r| r.strip_prefix(':'));
        let (reservation, rest) = turn(rest.ok_or(TicketError::Malformed)?)?;
        let mut fields = rest.splitn(4, ':');
        let mut next = || fields.next().ok_or(TicketError::Malformed);
        let until_ms = number(next()?)?;
        let nonce = unhex::<16>(next()?).ok_or(TicketError::Malformed)?;
        let mac = unhex::<32>(next()?).ok_or(TicketError::Malformed)?;
        let key = BucketKey::from_id(next()?).ok_or(TicketError::Malformed)?;
        let more = turns
            .map(|text| {
                let (r, key) = turn(text)?;
                let key = BucketKey::from_id(key).ok_or(TicketError::Malformed)?;
                Ok((key, r))
            })
            .collect::<Result<Vec<_>, TicketError>>()?;
        Ok(Self {
            key,
            reservation,
            more,
            until_ms,
            nonce,
            mac,
        })
    }
}

/// A whole number of the text: ASCII digits only, at most `u64::MAX`.
fn number(s: &str) -> Result<u64, TicketError> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse::<u64>().ok())
        .flatten()
        .ok_or(TicketError::Malformed)
}

/// The turn at the start of `text`, its reservation's three fields (the store's text of it, see
/// `Reservation::to_text`), and the rest of the text after them; a cost of zero is no turn.
fn turn(text: &str) -> Result<(Reservation, &str), TicketError> {
    let mut end = 0;
    for _ in 0..3 {
        end += text[end..].find(':').ok_or(TicketError::Malformed)? + 1;
    }
    let reservation = Reservation::from_text(&text[..end - 1])
        .filter(|r| r.cost() > 0)
        .ok_or(TicketError::Malformed)?;
    Ok((reservation, &text[end..]))
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Ticket");
        d.field("bucket", &self.key.bucket())
            .field("key", &self.key.fingerprint())
            .field("cost", &self.reservation.cost())
            .field("ready_at_ms", &self.reservation.ready_at_ms());
        if !self.more.is_empty() {
            let more: Vec<(&str, String)> = self
                .more
                .iter()
                .map(|(k, _)| (k.bucket(), k.fingerprint()))
                .collect();
            d.field("more", &more);
        }
        d.finish()
    }
}

crate::text::serde_as_text!(Ticket, "a burstgate ticket");

/// The secret a middleware signs its tickets with when given none: drawn from the operating
/// system's random source, so its tickets are good in its own process only.
pub(super) fn random_secret() -> KeySecret {
    KeySecret::new(crate::key::random_bytes())
        .unwrap_or_else(|_| unreachable!("32 bytes are more than the minimum"))
}

/// 16 random bytes: a ticket's nonce.
fn nonce() -> [u8; 16] {
    let bytes = crate::key::random_bytes();
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&bytes[..16]);
    nonce
}

/// Why a [`Ticket`](crate::middleware::Ticket) could not be read or used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TicketError {
    /// The text is not a ticket's (see the ticket's `Display`).
    Malformed,
    /// The ticket was booked in another bucket, or for another account, than the request it
    /// came with draws from: it cannot stand for that request's turn.
    OtherBucket,
    /// No route of the middleware draws from the ticket's bucket, so it has no limit to give
    /// the ticket's tokens back under.
    NoRoute,
    /// The ticket's signature is not the middleware's: it was written or changed by someone
    /// else, or signed by a middleware with another secret (see `key_secret`).
    Forged,
    /// The ticket was sent, or cancelled, already, here or in another process.
    Spent,
    /// The ticket's turn is more than its grace past (one token period per token of its
    /// cost): sent now, it would go with the turns booked after it. Or the store no longer
    /// holds its booking (lost in a flush, a restart without persistence or a failover), so it
    /// cannot tell whether the ticket went already. Its tokens stay spent; book again.
    Expired,
    /// The request costs more tokens than the ticket booked.
    TooCostly,
}

impl fmt::Display for TicketError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Malformed => "not a burstgate ticket",
            Self::OtherBucket => {
                "the ticket was booked for another bucket or account than the request's"
            }
            Self::NoRoute => "no route draws from the ticket's bucket",
            Self::Forged => "the ticket's signature is not this middleware's",
            Self::Spent => "the ticket was sent or cancelled already",
            Self::Expired => {
                "the ticket's turn is past its grace, or the store no longer holds its booking; book again"
            }
            Self::TooCostly => "the request costs more tokens than the ticket booked",
        })
    }
}

impl StdError for TicketError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_keyed_account_reveals_what_signs_tickets() {
        let secret = secret();
        let text = b"burstgate-ticket:1:5:1:s:00112233445566778899aabbccddeeff:orders:k";
        let sign = |secret: &KeySecret| {
            let mut mac = secret.signer();
            mac.update(text);
            <[u8; 32]>::from(mac.finalize().into_bytes())
        };
        let tag = sign(&secret);
        // Whatever account a client names, its keyed bucket key (written into Redis in clear)
        // is not the ticket key, nor a ticket's signature.
        for account in [
            &b"burstgate derived secret: tickets"[..],
            crate::key::SIGNING_KEY_LABEL,
            text,
        ] {
            let key = BucketKey::keyed("orders", account, &secret).unwrap();
            let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
            assert!(!key.as_str().contains(&hex));
        }
        let other = KeySecret::new(b"another application secret!!").unwrap();
        assert_ne!(sign(&other), tag);
    }

    fn secret() -> KeySecret {
        KeySecret::new(b"an application secret, sixteen+").unwrap()
    }

    fn ticket(key: &str, cost: u32, ready_at_ms: u64) -> Ticket {
        Ticket::signed(
            BucketKey::new("orders", key).expect("a key"),
            Reservation::new(
                cost,
                SystemTime::UNIX_EPOCH + Duration::from_millis(ready_at_ms),
            ),
            Vec::new(),
            Duration::from_millis(500),
            &secret(),
        )
    }

    #[test]
    fn a_ticket_reads_back_from_its_text_and_its_mac_holds() {
        let t = ticket("seller:42", 2, 1_796_000_000_123);
        let text = t.to_string();
        assert!(
            text.starts_with("burstgate-ticket:1:1796000000123:2:s:"),
            "{text}"
        );
        assert!(text.ends_with(":orders:seller%3A42"), "{text}");
        let back: Ticket = text.parse().expect("a ticket");
        assert_eq!(back, t);
        assert!(back.verify(&secret()));
        assert_eq!(t.cost(), 2);
        assert_eq!(t.bucket(), "orders");
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_000_000_000);
        assert_eq!(t.ready_in(at), Duration::from_millis(123));
        assert_eq!(
            t.ready_in(t.ready_at() + Duration::from_secs(1)),
            Duration::ZERO
        );
        // Debug shows the key's fingerprint, not the account.
        assert!(!format!("{t:?}").contains("seller"), "{t:?}");
        // Two tickets for the same turn differ by their nonces.
        assert_ne!(ticket("seller:42", 2, 1_796_000_000_123).nonce, t.nonce);
    }

    #[test]
    fn a_ticket_changed_or_signed_elsewhere_is_forged() {
        let t = ticket("seller-1", 1, 5);
        let other = KeySecret::new(b"another application secret!!").unwrap();
        assert!(!t.verify(&other));
        // Any field changed in the text: an earlier slot, a larger cost, another source, a
        // longer grace, another nonce or account.
        let text = t.to_string();
        let fields: Vec<&str> = text.splitn(9, ':').collect();
        for (i, changed) in [
            (2, "4"),
            (3, "3"),
            (4, "n"),
            (5, "99999"),
            (6, "00112233445566778899aabbccddeeff"),
        ] {
            let mut f = fields.clone();
            f[i] = changed;
            let edited: Ticket = f.join(":").parse().expect("still reads");
            assert!(!edited.verify(&secret()), "field {i}");
        }
        let moved: Ticket = text.replace("seller-1", "seller-2").parse().expect("reads");
        assert!(!moved.verify(&secret()));
    }

    #[test]
    fn anything_else_is_malformed() {
        let good = ticket("k", 1, 1).to_string();
        let fields: Vec<&str> = good.splitn(9, ':').collect();
        let with = |i: usize, v: &str| {
            let mut f = fields.clone();
            f[i] = v;
            f.join(":")
        };
        for bad in [
            String::new(),
            "burstgate-ticket:1".to_owned(),
            good.replacen("ticket:1", "ticket:2", 1),
            with(2, "x"),
            with(2, "+1"),
            with(3, "0"),
            with(3, "-1"),
            with(3, "4294967296"),
            with(4, "x"),
            with(5, "x"),
            with(6, "0011"),
            with(6, "00112233445566778899AABBCCDDEEFF"),
            with(7, "zz"),
            good.replace(":orders:k", ":orders"),
            good.replace(":orders:k", ":bad name:k"),
            good.replace(":orders:k", ":orders:%41"),
            // Another bucket's turn that is not one: a cost of zero, no key, a bad source.
            format!("{good};5:0:s:account:k"),
            format!("{good};5:1:s"),
            format!("{good};5:1:x:account:k"),
            // More turns than one call takes.
            format!("{good}{}", ";5:1:s:account:k".repeat(crate::MAX_TAKES)),
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
        assert_eq!(json, format!("\"{t}\""));
        assert_eq!(serde_json::from_str::<Ticket>(&json).expect("reads"), t);
    }
}
