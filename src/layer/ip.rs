//! Client addresses as bucket keys: IPv6 networks grouped by prefix, IPv4-mapped addresses read
//! as IPv4.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::request::Parts;

/// How much of an IPv6 address names one client: every address in the same network shares a
/// bucket.
///
/// An IPv6 client holds at least a `/64` (a home router, a cloud instance), often a `/56` or a
/// `/48`, and may pick a new address in it for every request, so keying on the whole address
/// would give it millions of buckets. The default is [`Slash64`](Self::Slash64); set another
/// with [`KeyExtractor::ipv6_prefix`](super::KeyExtractor::ipv6_prefix). IPv4
/// addresses are always keyed whole.
///
/// ```
/// use burstgate::layer::Ipv6Prefix;
///
/// assert_eq!(Ipv6Prefix::default(), Ipv6Prefix::Slash64);
/// assert_eq!(Ipv6Prefix::Slash56.bits(), 56);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Ipv6Prefix {
    /// A `/48`: the usual assignment to a site.
    Slash48,
    /// A `/56`: the usual assignment to a home or a small business.
    Slash56,
    /// A `/64`: one subnet, the least any IPv6 client holds.
    #[default]
    Slash64,
    /// The whole address, one bucket per address: only where each client really has one
    /// address, such as inside your own network.
    Slash128,
}

impl Ipv6Prefix {
    /// The prefix length in bits.
    pub fn bits(self) -> u8 {
        match self {
            Self::Slash48 => 48,
            Self::Slash56 => 56,
            Self::Slash64 => 64,
            Self::Slash128 => 128,
        }
    }
}

/// The address a key is made of: an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, what a
/// dual-stack socket reports for an IPv4 peer) is that IPv4 address, so it shares its bucket and
/// matches IPv4 proxy networks.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// The peer's address from the request's extensions, where the server put it.
pub(crate) fn peer_ip(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    if let Some(addr) = parts.extensions.get::<SocketAddr>() {
        return Some(addr.ip());
    }
    parts.extensions.get::<IpAddr>().copied()
}

/// Each octet's decimal digits followed by a dot, padded to four bytes, and how many of those
/// bytes are the text: 7 is `"7."`, 2 long; 255 is `"255."`, 4 long.
static OCTETS: [([u8; 4], u8); 256] = {
    let mut table = [([0; 4], 0); 256];
    let mut n = 0;
    while n < 256 {
        let octet = n as u8;
        let [h, t, o] = [
            b'0' + octet / 100,
            b'0' + octet / 10 % 10,
            b'0' + octet % 10,
        ];
        table[n] = if octet >= 100 {
            ([h, t, o, b'.'], 4)
        } else if octet >= 10 {
            ([t, o, b'.', 0], 3)
        } else {
            ([o, b'.', 0, 0], 2)
        };
        n += 1;
    }
    table
};

/// A client's key text, on the stack: `to_string` would allocate a `String` per request only
/// for the key to copy it.
///
/// IPv4: the address as `Display` writes it (`192.0.2.7`). IPv6 grouped by a prefix: the
/// network and its length (`2001:db8:1:2::/64`). IPv6 by [`Ipv6Prefix::Slash128`]: the address
/// (`2001:db8::7`).
pub(crate) struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl Default for IpText {
    fn default() -> Self {
        Self {
            buf: [0; 48],
            len: 0,
        }
    }
}

impl IpText {
    /// The key of `ip`, IPv6 grouped by `prefix`.
    pub(crate) fn key(ip: IpAddr, prefix: Ipv6Prefix) -> Self {
        let mut text = Self::default();
        match canonical(ip) {
            IpAddr::V4(v4) => text.write_v4(v4),
            IpAddr::V6(v6) if prefix == Ipv6Prefix::Slash128 => text.write_v6(v6),
            IpAddr::V6(v6) => {
                let bits = prefix.bits();
                let mask = u128::MAX << (128 - u32::from(bits));
                text.write_v6(Ipv6Addr::from(u128::from(v6) & mask));
                text.push(b'/');
                text.push(b'0' + bits / 10);
                text.push(b'0' + bits % 10);
            }
        }
        text
    }

    /// The common case, by hand: four decimal octets joined by dots, as `Display` has it. Each
    /// octet's text comes whole from [`OCTETS`], so an address costs four copies rather than a
    /// division and a bounds check per digit. Called on an empty text only.
    fn write_v4(&mut self, v4: Ipv4Addr) {
        let mut end = 0;
        for octet in v4.octets() {
            let (text, len) = OCTETS[usize::from(octet)];
            // Four octets of at most four bytes each, dot included: within the buffer.
            self.buf[end..end + 4].copy_from_slice(&text);
            end += usize::from(len);
        }
        // The last octet's dot stays in the buffer, past the text.
        self.len = end - 1;
    }

    /// The longest form, with an embedded IPv4 address, is 45 bytes, and a network with its
    /// length at most 43: both fit.
    fn write_v6(&mut self, v6: Ipv6Addr) {
        let _ = fmt::Write::write_fmt(self, format_args!("{v6}"));
    }

    fn push(&mut self, byte: u8) {
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let room = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        room.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ip: &str, prefix: Ipv6Prefix) -> String {
        let ip = ip.parse::<IpAddr>().expect("a valid address");
        String::from_utf8(IpText::key(ip, prefix).as_bytes().to_vec()).expect("ASCII")
    }

    #[test]
    fn keys_spell_addresses_as_display_does() {
        let mut addrs: Vec<IpAddr> = (0..=255u8)
            .map(|b| IpAddr::from([b, 255 - b, b / 10, b % 100]))
            .collect();
        addrs.extend(
            [
                "::",
                "::1",
                "::10.0.0.7",
                "2001:db8::8a2e:370:7334",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "64:ff9b::255.255.255.255",
            ]
            .map(|s| s.parse::<IpAddr>().expect("a valid address")),
        );
        for ip in addrs {
            let text = IpText::key(ip, Ipv6Prefix::Slash128);
            assert_eq!(text.as_bytes(), ip.to_string().as_bytes());
        }
    }

    #[test]
    fn ipv6_keys_name_the_network_and_its_length() {
        let ip = "2001:db8:1:2:aaaa:bbbb:cccc:dddd";
        assert_eq!(key(ip, Ipv6Prefix::Slash64), "2001:db8:1:2::/64");
        assert_eq!(key(ip, Ipv6Prefix::Slash56), "2001:db8:1::/56");
        assert_eq!(
            key("2001:db8:1:2ff::1", Ipv6Prefix::Slash56),
            "2001:db8:1:200::/56"
        );
        assert_eq!(key(ip, Ipv6Prefix::Slash48), "2001:db8:1::/48");
        assert_eq!(
            key(ip, Ipv6Prefix::Slash128),
            "2001:db8:1:2:aaaa:bbbb:cccc:dddd"
        );
        assert_eq!(key("::1", Ipv6Prefix::Slash64), "::/64");
        let longest = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff";
        assert_eq!(
            key(longest, Ipv6Prefix::Slash64),
            "ffff:ffff:ffff:ffff::/64"
        );
    }

    #[test]
    fn ipv4_mapped_addresses_are_keyed_as_ipv4() {
        for prefix in [
            Ipv6Prefix::Slash48,
            Ipv6Prefix::Slash64,
            Ipv6Prefix::Slash128,
        ] {
            assert_eq!(key("::ffff:10.0.0.7", prefix), "10.0.0.7");
            assert_eq!(key("10.0.0.7", prefix), "10.0.0.7");
        }
    }
}
