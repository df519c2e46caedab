//! Request paths in the form routes compare them.
//!
//! Two spellings of one resource must draw from one bucket, or a client (or a library between
//! it and the middleware) escapes its limit by spelling a path differently. The normalization
//! is RFC 3986's syntax-based one (§6.2.2), where it cannot change which resource a server
//! serves:
//!
//! - Percent-encoded unreserved characters (`ALPHA / DIGIT / "-" / "." / "_" / "~"`) are decoded:
//!   `%6Frders` is `orders`. Every other escape keeps its meaning and has its hex digits made
//!   upper case, so `%2f` and `%2F` are one thing: an encoded slash, part of a segment, never a
//!   separator.
//! - Dot segments are removed (§5.2.4), after the decoding, so `%2E` counts as a dot: `/a/./b` and
//!   `/a/x/../b` are `/a/b`.
//! - Bytes no URL carries as they are (anything outside printable ASCII) are percent-encoded in
//!   UTF-8, as a URL parser would, so that a pattern written `/café` meets `/caf%C3%A9`.
//!
//! Empty segments are left to the matcher, which skips them. Case in a path is significant, as
//! the RFC has it. A path that needs none of this is returned as it is, with no allocation: a
//! path out of a parsed URL has had its dot segments removed already, and usually has no escape.

use std::borrow::Cow;

/// `path` normalized as the module describes. The result starts with `/` when `path` does.
pub(super) fn normalize(path: &str) -> Cow<'_, str> {
    let plain = path.bytes().all(|b| b.is_ascii_graphic() && b != b'%');
    if plain && !path.split('/').any(is_dot_segment) {
        return Cow::Borrowed(path);
    }
    let decoded = decode(path);
    let (absolute, rest) = match decoded.strip_prefix('/') {
        Some(rest) => (true, rest),
        None => (false, decoded.as_str()),
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let mut out: Vec<&str> = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        if is_dot_segment(part) {
            if *part == ".." {
                out.pop();
            }
            // A dot segment at the end leaves the directory it names: a trailing slash.
            if i + 1 == parts.len() {
                out.push("");
            }
        } else {
            out.push(part);
        }
    }
    let mut normalized = String::with_capacity(decoded.len());
    if absolute {
        normalized.push('/');
    }
    for (i, part) in out.iter().enumerate() {
        if i > 0 {
            normalized.push('/');
        }
        normalized.push_str(part);
    }
    Cow::Owned(normalized)
}

fn is_dot_segment(segment: &str) -> bool {
    segment == "." || segment == ".."
}

/// Decodes escapes of unreserved characters, makes the hex digits of every other escape upper
/// case, and encodes bytes outside printable ASCII. A `%` not followed by two hex digits is left
/// as it is: it escapes nothing, and a URL parser passes it through the same way.
fn decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let escaped = match (b, bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&hi), Some(&lo)) => hex(hi).zip(hex(lo)).map(|(hi, lo)| hi << 4 | lo),
            _ => None,
        };
        match escaped {
            Some(c) if is_unreserved(c) => {
                out.push(char::from(c));
                i += 3;
            }
            Some(c) => {
                push_escape(&mut out, c);
                i += 3;
            }
            None if b.is_ascii_graphic() => {
                out.push(char::from(b));
                i += 1;
            }
            None => {
                push_escape(&mut out, b);
                i += 1;
            }
        }
    }
    out
}

fn push_escape(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0xf)]));
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986's `unreserved`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_that_needs_no_normalization_is_borrowed() {
        use std::borrow::Cow;
        assert!(matches!(
            normalize("/api/v1/supplier/orders"),
            Cow::Borrowed(_)
        ));
        assert!(matches!(normalize("//a/b.c/~d/"), Cow::Borrowed(_)));
        let cases = [
            ("/a/%6F", "/a/o"),
            ("/a/%2f%3a", "/a/%2F%3A"),
            ("/a/%zz/%4", "/a/%zz/%4"),
            ("/a/./b/../c", "/a/c"),
            ("/a/b/..", "/a/"),
            ("/a/.", "/a/"),
            ("/..", "/"),
            ("/a//../b", "/a/b"),
            ("/%25%36%46", "/%256F"),
            ("/caf\u{e9} x", "/caf%C3%A9%20x"),
        ];
        for (path, expected) in cases {
            assert_eq!(normalize(path), expected, "{path}");
        }
    }
}
