use super::*;

#[test]
fn name_errors_say_what_was_wrong() {
    let said = |name: &str| BucketName::new(name).map(drop).map_err(|e| e.to_string());
    assert_eq!(
        said(""),
        Err("invalid bucket name: it is empty (it must be 1 to 64 bytes)".into())
    );
    assert_eq!(
        said(&"x".repeat(70)),
        Err("invalid bucket name: it is 70 bytes long (at most 64)".into())
    );
    assert_eq!(
        said("a b"),
        Err(
            "invalid bucket name: byte 1 is ' ', not an ascii letter, digit, '_', '.' or '-'"
                .into()
        )
    );
    assert_eq!(
        said("caf\u{e9}"),
        Err(
            "invalid bucket name: byte 3 is 0xC3, not an ascii letter, digit, '_', '.' or '-'"
                .into()
        )
    );
    assert_eq!(said("a-b_c.9"), Ok(()));
}

#[test]
fn a_name_checked_once_makes_the_same_keys() {
    let secret = KeySecret::new([9u8; 16]).expect("a valid secret");
    let name = BucketName::new("orders").expect("a valid name");
    assert_eq!(name.key("s:1"), BucketKey::new("orders", "s:1"));
    assert_eq!(name.hashed_key("t"), BucketKey::hashed("orders", "t"));
    assert_eq!(
        name.keyed_key("t", &secret),
        BucketKey::keyed("orders", "t", &secret)
    );
    assert_eq!(name.key(""), Err(InvalidKey::EmptyKey));
    assert_eq!("orders".parse::<BucketName>(), Ok(name.clone()));
    assert_eq!(format!("{name} {name:?}"), "orders BucketName(\"orders\")");
}

#[test]
fn separators_and_hash_tags_are_escaped() {
    let k = BucketKey::new("b", "a:{x}\n %#").map(|k| k.as_str().to_owned());
    assert_eq!(k.as_deref(), Ok("b:a%3A%7Bx%7D%0A%20%25%23"));
}

#[test]
fn binary_keys_are_escaped_and_distinct() {
    let a = BucketKey::new("b", [0u8, 255]);
    let b = BucketKey::new("b", "%00%FF");
    assert_eq!(a.as_ref().map(|k| k.as_str()), Ok("b:%00%FF"));
    assert_eq!(b.as_ref().map(|k| k.as_str()), Ok("b:%2500%25FF"));
}

#[test]
fn huge_keys_are_hashed_to_a_fixed_size() {
    let huge = vec![b'x'; 1 << 20];
    let k = BucketKey::new("b", &huge).map(|k| k.as_str().len());
    assert_eq!(k, Ok(2 + 1 + 64));
    // Just under the threshold stays readable.
    let k = BucketKey::new("b", [b'y'; 128]).map(|k| k.as_str().len());
    assert_eq!(k, Ok(2 + 128));
}

#[test]
fn secrets_never_appear_in_clear() {
    let k = BucketKey::hashed("orders", "token-abc").map(|k| k.to_string());
    let k = k.unwrap_or_default();
    assert!(k.starts_with("orders:#") && !k.contains("token"), "{k}");
    assert!(!format!("{:?}", BucketKey::hashed("o", "token-abc")).contains("token"));
}

#[test]
fn keyed_hashes_cannot_be_checked_without_the_secret() {
    let a = KeySecret::new([1u8; 16]).expect("a valid secret");
    let b = KeySecret::new([2u8; 16]).expect("a valid secret");
    let basic = "Basic dXNlcjpodW50ZXIy";
    let plain = BucketKey::hashed("login", basic).expect("a valid key");
    let keyed = BucketKey::keyed("login", basic, &a).expect("a valid key");
    let other = BucketKey::keyed("login", basic, &b).expect("a valid key");
    // An unkeyed hash is what anyone can compute from a guess; a keyed one is not.
    assert_eq!(
        plain.as_str(),
        format!("login:#{:x}", Sha256::digest(basic))
    );
    assert_ne!(keyed, plain);
    assert_ne!(keyed, other);
    assert_eq!(keyed.as_str().len(), "login:#".len() + 64);
    assert!(!keyed.as_str().contains("dXNl"));
    // The same secret names the same bucket, in every process.
    assert_eq!(BucketKey::keyed("login", basic, &a), Ok(keyed));
    assert_eq!(format!("{a:?}"), "KeySecret(<secret>)");
}

/// Held by the tests that compare fingerprints taken at different moments, and by the one that
/// changes the process's fingerprint key: the unit tests share one process.
static FINGERPRINT_KEY_HELD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn hold_fingerprint_key() -> std::sync::MutexGuard<'static, ()> {
    FINGERPRINT_KEY_HELD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn an_ipv4_fingerprint_does_not_reverse_by_enumeration() {
    let _held = hold_fingerprint_key();
    let key = BucketKey::new("ip", "203.0.113.7").expect("a valid key");
    let fp = key.fingerprint();
    assert_eq!(fp.len(), 12);
    assert_eq!(key.fingerprint(), fp, "stable within the process");
    // What an attacker who enumerates addresses would compute: the unsalted hash.
    let unsalted: String = Sha256::digest(key.as_str())[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_ne!(fp, unsalted);
}

/// Every form a constructor writes reads back as the same key, with the same fingerprint; any
/// other spelling of it reads back as nothing, so no two texts name one bucket.
#[test]
fn a_key_read_back_from_its_text_is_the_same_key() {
    let _held = hold_fingerprint_key();
    let secret = KeySecret::new(b"an application secret, sixteen+").unwrap();
    for key in [
        BucketKey::new("orders", "seller:42").unwrap(),
        BucketKey::new("ip", [10u8, 0, 0, 255]).unwrap(),
        BucketKey::new("orders", "x".repeat(200)).unwrap(),
        BucketKey::hashed("orders", "Bearer t").unwrap(),
        BucketKey::keyed("orders", "Bearer t", &secret).unwrap(),
    ] {
        let back = BucketKey::from_escaped(key.as_str());
        assert_eq!(
            back.as_ref().map(BucketKey::fingerprint),
            Some(key.fingerprint())
        );
        assert_eq!(back, Some(key));
    }
    for bad in [
        "orders",
        "orders:",
        "bad name:k",
        "orders:a:b",
        "orders:%3a",
        "orders:%41",
        "orders:%4",
        "orders:#abc",
        "orders:#ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789",
        "orders:a b",
    ] {
        assert_eq!(BucketKey::from_escaped(bad), None, "{bad}");
    }
    assert_eq!(
        BucketKey::from_escaped(&format!("o:{}", "a".repeat(129))),
        None
    );
}

#[test]
fn bad_names_and_empty_keys_are_refused() {
    let name = |why| Err(InvalidKey::BucketName(why));
    assert_eq!(BucketKey::new("", "k"), name(InvalidName::Empty));
    let colon = InvalidName::Character {
        index: 1,
        byte: b':',
    };
    assert_eq!(BucketKey::new("a:b", "k"), name(colon));
    assert_eq!(
        BucketKey::new(&"n".repeat(65), "k"),
        name(InvalidName::TooLong { len: 65 })
    );
    assert_eq!(BucketKey::new(&"n".repeat(64), "k").map(drop), Ok(()));
    assert_eq!(BucketKey::new("orders", ""), Err(InvalidKey::EmptyKey));
    assert_eq!(BucketKey::hashed("orders", ""), Err(InvalidKey::EmptyKey));
    let secret = KeySecret::new([7u8; 16]).expect("a valid secret");
    assert_eq!(
        BucketKey::keyed("orders", "", &secret),
        Err(InvalidKey::EmptyKey)
    );
    assert_eq!(
        KeySecret::new([7u8; 15]).err(),
        Some(InvalidKey::ShortSecret)
    );
    assert_eq!(
        BucketKey::new("orders", "k").map(|k| k.bucket().to_owned()),
        Ok("orders".into())
    );
}

/// Keyed with a secret, a fingerprint is a function of the secret and the key alone: the same in
/// every process and after a restart, which is what lets the command-line tool, given the secret,
/// name a client as the application's logs do. A front end's secret does not replace a chosen one.
#[test]
fn a_fingerprint_keyed_with_a_secret_depends_on_the_secret_and_the_key_alone() {
    let _held = hold_fingerprint_key();
    let secret = KeySecret::new(b"the application's secret, 32 b..").expect("a secret");
    secret.key_fingerprints();
    let key = BucketKey::new("orders", "seller-42").expect("a key");
    let expected = {
        let mut derive = HmacSha256::new_from_slice(FINGERPRINT_KEY_LABEL).expect("any length");
        derive.update(b"the application's secret, 32 b..");
        let derived = derive.finalize().into_bytes();
        let mut mac = HmacSha256::new_from_slice(&derived).expect("any length");
        mac.update(key.as_str().as_bytes());
        let mut out = String::new();
        push_hex(&mut out, &mac.finalize().into_bytes()[..6]);
        out
    };
    assert_eq!(key.fingerprint(), expected);
    assert_eq!(key.fingerprint().len(), 12);

    let other = KeySecret::new(b"another secret of 16 bytes or more").expect("a secret");
    other.offer_for_fingerprints();
    assert_eq!(
        key.fingerprint(),
        expected,
        "the chosen secret still keys them"
    );
    other.key_fingerprints();
    assert_ne!(key.fingerprint(), expected, "a secret chosen later does");
    secret.key_fingerprints();
}

/// An id is kept inside the key up to 45 bytes and on the heap past that: either way it reads,
/// compares and hashes as its text, and reads back as the same key. Escaping after a key's first
/// bytes were copied as they are writes over them, and a key that grows past 128 bytes as it is
/// escaped is hashed.
#[test]
fn short_and_long_ids_read_compare_and_hash_as_their_text() {
    use std::hash::BuildHasher;
    let hasher = std::collections::hash_map::RandomState::new();
    let escaped = |key: &[u8]| -> String {
        key.iter()
            .map(|&b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' | b'@' | b'/' => {
                    char::from(b).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    for n in 1..=140 {
        for raw in [
            "k".repeat(n).into_bytes(),
            format!("{}:", "k".repeat(n - 1)).into_bytes(),
            (0..n).map(|i| (i * 37 % 256) as u8).collect(),
        ] {
            let key = BucketKey::new("bucket", &raw).expect("a valid key");
            let text = escaped(&raw);
            let expected = if text.len() <= 128 {
                format!("bucket:{text}")
            } else {
                format!("bucket:#{:x}", Sha256::digest(&raw))
            };
            assert_eq!(key.as_str(), expected);
            assert_eq!(key.to_string(), expected);
            assert_eq!(key.bucket(), "bucket");
            assert_eq!(key.caller(), &expected["bucket:".len()..]);
            let back = BucketKey::from_escaped(key.as_str()).expect("the key's own text");
            assert_eq!(back.as_str(), key.as_str());
            assert_eq!(hasher.hash_one(&back), hasher.hash_one(&key));
            assert_eq!(back, key);
        }
    }
    assert_ne!(
        BucketKey::new("b", "x".repeat(43)),
        BucketKey::new("b", "x".repeat(44))
    );
    for n in 1..=64 {
        let name: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let key = BucketKey::new(&name, "k-7").expect("a valid key");
        assert_eq!(key.as_str(), format!("{name}:k-7"));
        assert_eq!(key.bucket(), name);
        assert_eq!(key.caller(), "k-7");
    }
}

/// 45 inline bytes, the enum's tag and two lengths fill 48 bytes exactly, and the hash and the
/// store's hint 16 more: one inline byte more would make every key, and every copy of one, 72.
#[test]
fn a_key_is_64_bytes() {
    assert_eq!(std::mem::size_of::<BucketKey>(), 64);
}

/// Equal keys carry equal hashes however they were made, since a store finds a bucket by the
/// hash the key brings: the short path, the written one, and a key read back from its text.
#[test]
fn equal_keys_carry_equal_hashes() {
    let short = BucketKey::new("api", "client-7").unwrap();
    let read_back = BucketKey::from_escaped("api:client-7").unwrap();
    assert_eq!(short, read_back);
    assert_eq!(short.id_hash(), read_back.id_hash());
    // Escaped: written on the stack, then inline.
    let escaped = BucketKey::new("api", "a b").unwrap();
    let escaped_back = BucketKey::from_escaped(escaped.as_str()).unwrap();
    assert_eq!(escaped.id_hash(), escaped_back.id_hash());
    // Hashed: on the heap.
    let long = BucketKey::new("api", "x".repeat(200)).unwrap();
    let long_back = BucketKey::from_escaped(long.as_str()).unwrap();
    assert_eq!(long.id_hash(), long_back.id_hash());
    assert_eq!(
        long.id_hash(),
        crate::store::sharding::key_hash(long.as_bytes())
    );
    assert_ne!(short.id_hash(), escaped.id_hash());
}
