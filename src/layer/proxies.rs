//! The client behind trusted proxies: the peer's address, or the nearest untrusted address the
//! proxies' forwarded-for header names.

use std::error::Error as StdError;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::{IpNet, Ipv4Net};

use super::ip::canonical;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The networks of your own proxies (load balancers, CDNs, ingress), for
/// [`KeyExtractor::client_ip`](super::KeyExtractor::client_ip), and the header they write the
/// client's address into.
///
/// # How the client is found
///
/// 1. The peer (the connection's address, found as [`peer_ip`](super::KeyExtractor::peer_ip)
///    finds it) is the client unless it is in a trusted network. A client that connects
///    directly and sends a forwarded-for header of its own is keyed by its own address: the
///    header is not read.
/// 2. Otherwise the header's entries are read from the right, the nearest hop first (every
///    line of the header, in order, as one list, as HTTP combines field lines). Trusted
///    addresses are skipped; the first untrusted one is the client. The entries left of it
///    are never read: they are whatever the client sent, while each entry right of it was
///    written by one of your proxies.
/// 3. An entry that names no address (not an address, `unknown`, an obfuscated identifier such
///    as `_hidden`, a `Forwarded` element without `for=` or with it twice) stops the walk. The
///    request is keyed by the trusted hop that wrote the entry (the last one reached): the
///    proxy could not say who its peer was, so its requests share its bucket. A client cannot
///    reach this by writing such an entry itself, since whatever it writes is left of its own
///    address.
/// 4. When the entries run out, every one trusted (or the header is absent), the request
///    began inside your networks (a health check, an internal caller): it is keyed by the last
///    trusted address reached, the leftmost entry, or the peer if there is none.
///
/// Only one header is read: `X-Forwarded-For` by default, or `Forwarded` (RFC 7239) with
/// [`header`](Self::header). Choose the one your proxies write; the other is ignored,
/// since a client could send it with anything in it. Entries may carry a port (`192.0.2.7:443`,
/// `[2001:db8::7]:443`, in `Forwarded` quoted: `for="[2001:db8::7]:443"`), which is ignored,
/// and IPv6 addresses may be bracketed. An IPv4-mapped address (`::ffff:192.0.2.7`) counts as
/// its IPv4 address, for trust and for the key. The client's key is grouped as `peer_ip`'s is
/// (IPv6 by its `/64`, see [`Ipv6Prefix`](super::Ipv6Prefix)).
///
/// Every address in a trusted network can name any client, so list your proxies' networks
/// only, never the networks your clients connect from; a network of every address is refused
/// ([`InvalidProxy::Everyone`]).
///
/// What the walk cannot know, and you should check against your proxies:
///
/// - Several header lines are read as one list, in order. A proxy that appends the client to
///   the first of several lines the client sent, and passes the others on, would let the
///   client's later lines stand right of its real address; proxies that merge or replace the
///   lines (as HTTP allows them to) are safe.
/// - A request keyed by a trusted hop (step 3 or 4) shares that hop's bucket with its other
///   such requests, its health checks included.
/// - Only IPv4-mapped addresses are read as IPv4. Behind a NAT64 translator every IPv4 client
///   arrives from `64:ff9b::/96`, one `/64`; key such traffic with
///   [`from_fn`](super::KeyExtractor::from_fn) on the embedded address, or group by `/128`.
///   The `/64` of a Teredo (`2001::/32`) address is its relay's, shared by its clients, and a
///   6to4 (`2002::/16`) host owns a `/48`.
///
/// ```
/// use std::net::IpAddr;
/// use burstgate::layer::{ForwardedHeader, TrustedProxies};
/// use http::HeaderMap;
///
/// let proxies = TrustedProxies::new(["10.0.0.0/8", "fd00::/8"])?;
/// let lb: IpAddr = "10.0.0.2".parse()?;
///
/// // The client prepended an address of its own; its proxy appended the real one.
/// let mut headers = HeaderMap::new();
/// headers.insert("x-forwarded-for", "203.0.113.9, 198.51.100.20, 10.0.0.3".parse()?);
/// assert_eq!(proxies.client(lb, &headers), "198.51.100.20".parse::<IpAddr>()?);
///
/// // Not through a trusted proxy: the header is the client's own and is not read.
/// let direct: IpAddr = "198.51.100.20".parse()?;
/// assert_eq!(proxies.client(direct, &headers), direct);
///
/// let proxies = proxies.header(ForwardedHeader::Forwarded);
/// let mut headers = HeaderMap::new();
/// headers.insert("forwarded", r#"for="[2001:db8:cafe::17]:4711";proto=https"#.parse()?);
/// assert_eq!(proxies.client(lb, &headers), "2001:db8:cafe::17".parse::<IpAddr>()?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct TrustedProxies {
    nets: Arc<[IpNet]>,
    header: ForwardedHeader,
}

/// The header [`TrustedProxies`] reads the client's address from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: <client>, <proxy 1>, <proxy 2>`: what most load balancers write.
    #[default]
    XForwardedFor,
    /// `Forwarded: for=<client>, for=<proxy 1>` (RFC 7239): the `for=` parameter of each
    /// element.
    Forwarded,
}

impl ForwardedHeader {
    fn name(self) -> &'static HeaderName {
        match self {
            Self::XForwardedFor => &X_FORWARDED_FOR,
            Self::Forwarded => &http::header::FORWARDED,
        }
    }
}

impl TrustedProxies {
    /// Trusts the proxies in `networks`: each a network in CIDR notation (`10.0.0.0/8`,
    /// `2001:db8::/32`) or a single address (`10.0.0.2`). A network written with bits set past
    /// its length (`10.0.0.1/8`) is refused as likely a typo, as is anything that is not an
    /// address or a network; the error gives its position. An empty list trusts no one: the
    /// client is always the peer.
    pub fn new<I>(networks: I) -> Result<Self, InvalidProxy>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let nets = networks
            .into_iter()
            .enumerate()
            .map(|(index, s)| parse_net(s.as_ref(), index))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            nets: nets.into(),
            header: ForwardedHeader::default(),
        })
    }

    /// Reads `header` instead of `X-Forwarded-For`.
    #[must_use]
    pub fn header(self, header: ForwardedHeader) -> Self {
        Self { header, ..self }
    }

    /// The client of a request that arrived from `peer` with `headers`, found as described
    /// [above](Self#how-the-client-is-found). IPv4-mapped addresses come back as IPv4.
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let mut nearest = canonical(peer);
        if !self.trusts(nearest) {
            return nearest;
        }
        for line in headers.get_all(self.header.name()).iter().rev() {
            let line = line.as_bytes();
            let found = match self.header {
                ForwardedHeader::XForwardedFor => {
                    self.walk(&mut nearest, line.rsplit(|&b| b == b',').map(xff_node))
                }
                ForwardedHeader::Forwarded => {
                    self.walk(&mut nearest, Elements::new(line).map(forwarded_for))
                }
            };
            if let Some(client) = found {
                return client;
            }
        }
        nearest
    }

    /// Walks `nodes`, nearest first, past trusted addresses: the client, or `None` to read on
    /// with `nearest` the last trusted address reached.
    fn walk(
        &self,
        nearest: &mut IpAddr,
        nodes: impl Iterator<Item = Option<IpAddr>>,
    ) -> Option<IpAddr> {
        for node in nodes {
            let Some(ip) = node.map(canonical) else {
                return Some(*nearest);
            };
            if !self.trusts(ip) {
                return Some(ip);
            }
            *nearest = ip;
        }
        None
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|net| net.contains(&ip))
    }
}

impl fmt::Debug for TrustedProxies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrustedProxies")
            .field("networks", &self.nets)
            .field("header", &self.header)
            .finish()
    }
}

fn parse_net(s: &str, index: usize) -> Result<IpNet, InvalidProxy> {
    let s = s.trim();
    let net = match s.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => IpNet::from(
            s.parse::<IpAddr>()
                .map_err(|_| InvalidProxy::Syntax { index })?,
        ),
    };
    if net.trunc() != net {
        return Err(InvalidProxy::HostBits { index });
    }
    // Addresses are compared as IPv4 when mapped, so a mapped network must be one too.
    if let IpNet::V6(v6) = net
        && v6.prefix_len() >= 96
        && let Some(v4) = v6.network().to_ipv4_mapped()
        && let Ok(v4) = Ipv4Net::new(v4, v6.prefix_len() - 96)
    {
        return checked(IpNet::V4(v4), index);
    }
    checked(net, index)
}

/// Refuses a network of every address.
fn checked(net: IpNet, index: usize) -> Result<IpNet, InvalidProxy> {
    if net.prefix_len() == 0 {
        return Err(InvalidProxy::Everyone { index });
    }
    Ok(net)
}

/// An `X-Forwarded-For` entry's address.
fn xff_node(entry: &[u8]) -> Option<IpAddr> {
    node(std::str::from_utf8(entry.trim_ascii()).ok()?)
}

/// The address of a node, `192.0.2.7`, `2001:db8::7`, `[2001:db8::7]`, each but the bare IPv6
/// form with an optional port (`:443`) or obfuscated port (`:_p1`); `None` for anything else.
fn node(s: &str) -> Option<IpAddr> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        if !after.is_empty() && !after.strip_prefix(':').is_some_and(is_port) {
            return None;
        }
        return host.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    let (host, port) = s.split_once(':')?;
    if !is_port(port) {
        return None;
    }
    host.parse::<Ipv4Addr>().ok().map(IpAddr::V4)
}

/// RFC 7239's `node-port`: a port number, or `_` and an obfuscated one.
fn is_port(s: &str) -> bool {
    match s.strip_prefix('_') {
        Some(obfuscated) => {
            !obfuscated.is_empty()
                && obfuscated
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        }
        None => s.parse::<u16>().is_ok() && s.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// The elements of a `Forwarded` line, last first, split at commas outside quoted strings.
/// Read from the right so that the elements the proxies appended are read whole whatever the
/// client put before them, an unclosed quote included.
struct Elements<'a> {
    line: &'a [u8],
    /// The end of what is left to read; `None` once the first element was returned.
    end: Option<usize>,
}

impl<'a> Elements<'a> {
    fn new(line: &'a [u8]) -> Self {
        Self {
            line,
            end: Some(line.len()),
        }
    }
}

impl<'a> Iterator for Elements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let rest = self.line.get(..self.end?)?;
        let mut quoted = false;
        for (i, &b) in rest.iter().enumerate().rev() {
            match b {
                b'"' if !escaped(rest, i) => quoted = !quoted,
                b',' if !quoted => {
                    self.end = Some(i);
                    return rest.get(i + 1..);
                }
                _ => {}
            }
        }
        self.end = None;
        Some(rest)
    }
}

/// Whether the byte at `i` follows an odd run of backslashes (a quoted-pair). Each backslash is
/// counted for one quote at most, so a line is read in linear time.
fn escaped(bytes: &[u8], i: usize) -> bool {
    let run = bytes[..i].iter().rev().take_while(|&&b| b == b'\\').count();
    run % 2 == 1
}

/// The address in an element's one `for=` parameter; `None` if it has none, has two, or names
/// no address.
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    let mut value = None;
    let mut rest = element;
    while !rest.is_empty() {
        let (pair, after) = split_pair(rest);
        rest = after;
        let pair = pair.trim_ascii();
        if pair.is_empty() {
            continue;
        }
        let eq = pair.iter().position(|&b| b == b'=')?;
        let (name, v) = (pair[..eq].trim_ascii(), pair[eq + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"for") {
            if value.is_some() {
                return None;
            }
            value = Some(v);
        }
    }
    let mut buf = [0u8; 64];
    node(unquote(value?, &mut buf)?)
}

/// The first `;`-separated pair of `s` and what follows it, `;` inside a quoted string kept.
fn split_pair(s: &[u8]) -> (&[u8], &[u8]) {
    let mut quoted = false;
    let mut escape = false;
    for (i, &b) in s.iter().enumerate() {
        match b {
            _ if escape => escape = false,
            b'\\' if quoted => escape = true,
            b'"' => quoted = !quoted,
            b';' if !quoted => return (&s[..i], &s[i + 1..]),
            _ => {}
        }
    }
    (s, &[])
}

/// A parameter value as text: a token as it is, a quoted string without its quotes and with
/// its quoted-pairs resolved, into `buf`. Longer than any node (`None`) is not an address.
fn unquote<'b>(value: &[u8], buf: &'b mut [u8; 64]) -> Option<&'b str> {
    let inner = match value {
        [b'"', inner @ .., b'"'] => inner,
        [b'"', ..] => return None,
        token => token,
    };
    let mut len = 0;
    let mut escape = false;
    for &b in inner {
        if !escape && b == b'\\' {
            escape = true;
            continue;
        }
        escape = false;
        *buf.get_mut(len)? = b;
        len += 1;
    }
    std::str::from_utf8(buf.get(..len)?).ok()
}

/// Why [`TrustedProxies::new`](crate::layer::TrustedProxies::new) refused a network.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidProxy {
    /// Entry number `index` (from 0) is neither an IP address nor a network in CIDR notation.
    Syntax {
        /// The entry's position in the list.
        index: usize,
    },
    /// Entry number `index` (from 0) has bits set past its prefix length, such as
    /// `10.0.0.1/8`: write the network (`10.0.0.0/8`) or the address alone (`10.0.0.1`).
    HostBits {
        /// The entry's position in the list.
        index: usize,
    },
    /// Entry number `index` (from 0) is every address (`0.0.0.0/0`, `::/0`, or `::ffff:0:0/96`,
    /// every IPv4-mapped one): trusting every peer would let any client name its own bucket in
    /// the header. Use [`KeyExtractor::peer_ip`](crate::layer::KeyExtractor::peer_ip) if there is no
    /// proxy, or list the proxies' networks.
    Everyone {
        /// The entry's position in the list.
        index: usize,
    },
}

impl fmt::Display for InvalidProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Syntax { index } => write!(
                f,
                "trusted proxy {index} is neither an ip address nor a cidr network"
            ),
            Self::HostBits { index } => write!(
                f,
                "trusted proxy {index} has bits set past its prefix length"
            ),
            Self::Everyone { index } => write!(
                f,
                "trusted proxy {index} is every address, which would let clients choose their key"
            ),
        }
    }
}

impl StdError for InvalidProxy {}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("a valid address")
    }

    #[test]
    fn nodes_with_ports_brackets_or_neither() {
        for (text, want) in [
            ("192.0.2.7", Some("192.0.2.7")),
            ("192.0.2.7:443", Some("192.0.2.7")),
            ("192.0.2.7:_p", Some("192.0.2.7")),
            ("2001:db8::7", Some("2001:db8::7")),
            ("[2001:db8::7]", Some("2001:db8::7")),
            ("[2001:db8::7]:443", Some("2001:db8::7")),
            ("[2001:db8::7]x", None),
            ("[2001:db8::7]:", None),
            ("192.0.2.7:", None),
            ("192.0.2.7:+80", None),
            ("192.0.2.7:65536", None),
            ("192.0.2.7:_", None),
            ("[192.0.2.7]", None),
            ("unknown", None),
            ("_hidden", None),
            ("", None),
            ("300.0.0.1", None),
        ] {
            assert_eq!(node(text), want.map(ip), "{text}");
        }
    }

    #[test]
    fn forwarded_elements_split_outside_quotes_from_the_right() {
        let line = br#"for="a,b";by=x, for=192.0.2.1 ,for="[2001:db8::1]:80""#;
        let elements: Vec<&[u8]> = Elements::new(line).collect();
        assert_eq!(
            elements,
            [
                &br#"for="[2001:db8::1]:80""#[..],
                &b" for=192.0.2.1 "[..],
                &br#"for="a,b";by=x"#[..]
            ]
        );
        // An unclosed quote on the left does not swallow the elements to its right.
        let line = br#"for="oops, for=192.0.2.1, for=198.51.100.2"#;
        let mut elements = Elements::new(line);
        assert_eq!(elements.next(), Some(&b" for=198.51.100.2"[..]));
        assert_eq!(elements.next(), Some(&b" for=192.0.2.1"[..]));
    }

    #[test]
    fn forwarded_for_reads_one_for_parameter() {
        for (element, want) in [
            (
                &br#"for=192.0.2.60;proto=http;by=203.0.113.43"#[..],
                Some("192.0.2.60"),
            ),
            (
                br#"For="[2001:db8:cafe::17]:4711""#,
                Some("2001:db8:cafe::17"),
            ),
            (
                br#"proto=https; for="\[2001:db8::1\]""#,
                Some("2001:db8::1"),
            ),
            (br#"for="192.0.2.1;x";by=a"#, None),
            (b"for=unknown", None),
            (b"for=_gazonk", None),
            (br#"for="_gazonk""#, None),
            (b"proto=https", None),
            (b"for=192.0.2.1;for=192.0.2.2", None),
            (b"for", None),
            (br#"for="192.0.2.1"#, None),
        ] {
            let text = String::from_utf8_lossy(element).into_owned();
            assert_eq!(forwarded_for(element), want.map(ip), "{text}");
        }
    }

    #[test]
    fn networks_are_parsed_strictly_and_mapped_ones_as_ipv4() {
        let proxies = TrustedProxies::new([" 10.0.0.0/8", "::ffff:192.0.2.0/120", "fd00::1"])
            .expect("valid networks");
        assert!(proxies.trusts(ip("10.1.2.3")));
        assert!(proxies.trusts(ip("192.0.2.200")));
        assert!(proxies.trusts(ip("fd00::1")));
        assert!(!proxies.trusts(ip("fd00::2")));
        assert!(!proxies.trusts(ip("11.0.0.1")));
        assert_eq!(
            TrustedProxies::new(["10.0.0.0/8", "10.0.0.1/8"]).map(drop),
            Err(InvalidProxy::HostBits { index: 1 })
        );
        for bad in ["10.0.0.0/33", "proxy.internal", "", "10.0.0.0/", "::/129"] {
            assert_eq!(
                TrustedProxies::new(["::1", bad]).map(drop),
                Err(InvalidProxy::Syntax { index: 1 }),
                "{bad}"
            );
        }
        assert_eq!(
            InvalidProxy::HostBits { index: 3 }.to_string(),
            "trusted proxy 3 has bits set past its prefix length"
        );
    }

    #[test]
    fn trusting_every_address_lets_a_client_choose_its_key_and_is_refused() {
        for everyone in ["0.0.0.0/0", "::/0", "::ffff:0:0/96"] {
            assert_eq!(
                TrustedProxies::new(["10.0.0.0/8", everyone]).map(drop),
                Err(InvalidProxy::Everyone { index: 1 }),
                "{everyone}"
            );
        }
        // Broad networks that are not everything stay allowed.
        assert!(TrustedProxies::new(["10.0.0.0/8", "::ffff:10.0.0.0/104", "fc00::/7"]).is_ok());
    }
}
