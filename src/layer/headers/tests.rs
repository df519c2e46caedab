//! The header fields checked against the drafts (draft-ietf-httpapi-ratelimit-headers-11 by
//! default, 10 and 06 on request): every shape written is parsed with an RFC 9651 parser.
//! Failures are persisted by proptest in `proptest-regressions/layer/headers/tests.txt`.

use proptest::prelude::*;
use sfv::{BareItem, ListEntry, Parser};

use super::*;
use crate::bucket::{self, Params, State};

fn limit(tokens: u32, interval_ms: u64, burst: u32) -> Limit {
    Limit::new(tokens, Duration::from_millis(interval_ms))
        .and_then(|l| l.with_burst(burst))
        .expect("a valid limit")
}

/// A request of `cost` at `now` (ms) on a bucket stored as `state`, as every store decides
/// it, with the state it leaves.
fn decide(
    limit: Limit,
    state: Option<State>,
    now: u64,
    cost: u32,
    max_wait: u64,
) -> (Decision, Option<State>) {
    let p = Params::of(&limit);
    let (outcome, write) = bucket::evaluate(&p, state, now, f64::from(cost), max_wait);
    let state = write.map(|w| w.state).or(state);
    (Decision::new(outcome, limit, cost), state)
}

/// `n` requests of cost 1 at 0 ms on a full bucket, then the decision on one more at `at`.
fn after(limit: Limit, n: u32, at: u64) -> (Decision, Option<State>) {
    let mut state = None;
    for _ in 0..n {
        state = decide(limit, state, 0, 1, 0).1;
    }
    decide(limit, state, at, 1, 0)
}

fn text(v: Option<HeaderValue>) -> Option<String> {
    v.and_then(|v| v.to_str().ok().map(str::to_owned))
}

#[test]
fn seconds_round_up() {
    assert_eq!(ceil_secs(Duration::ZERO), 0);
    assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
    assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
    assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
    assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
}

#[test]
fn text_writes_numbers_and_spills_past_its_inline_room() {
    let mut text = Text::new();
    for n in [0, 7, 10, 99, 1_000_000, u64::from(u32::MAX), u64::MAX] {
        text.push_u64(n);
        text.push(b" ");
    }
    let written = "0 7 10 99 1000000 4294967295 18446744073709551615 ";
    assert_eq!(text.as_bytes(), written.as_bytes());
    let long = "x".repeat(INLINE);
    text.push(long.as_bytes());
    text.push(b"!");
    assert_eq!(text.as_bytes(), format!("{written}{long}!").as_bytes());
    assert!(Text::new().header_value().is_none());
    for n in (0..=100_000).chain([u64::from(u32::MAX) - 1, u64::MAX - 1]) {
        assert_eq!(decimal(n, &mut [0; 20]), n.to_string().as_bytes());
    }
}

#[test]
fn quota_and_window_are_what_the_limit_sustains() {
    for (l, q, w) in [
        // A refill from empty under a second: the window is one second, and the quota what
        // refills in it, not the burst.
        (limit(10, 1000, 3), 10, 1),
        (limit(10, 1000, 10), 10, 1),
        (limit(10, 1000, 20), 20, 2),
        (limit(1, 60_000, 10), 10, 600),
        (limit(1, 60_000, 1), 1, 60),
        (limit(100, 3_600_000, 100), 100, 3600),
        // 1.5 s to refill from empty: two seconds, in which 4 tokens refill.
        (limit(3, 1500, 3), 4, 2),
        // 3/7 s from empty, 2.33 tokens a second: 2, rounded down, sustained.
        (limit(7, 3000, 1), 2, 1),
        (limit(5, 2000, 5), 5, 2),
        // Extremes: every token a millisecond, and the slowest limits.
        (limit(u32::MAX, 1, u32::MAX), u64::from(u32::MAX) * 1000, 1),
        (limit(u32::MAX, 1, 1), u64::from(u32::MAX) * 1000, 1),
        (limit(1, 1 << 42, 1), 1, (1u64 << 42).div_ceil(1000)),
        (
            limit(u32::MAX, 1 << 42, u32::MAX),
            u64::from(u32::MAX),
            (1u64 << 42).div_ceil(1000),
        ),
        (limit(u32::MAX, 1000, u32::MAX), u64::from(u32::MAX), 1),
        (
            limit(u32::MAX - 1, 1000, u32::MAX),
            u64::from(u32::MAX - 1) * 2,
            2,
        ),
    ] {
        assert_eq!(quota(l), (q, w), "{l}");
    }
    let item = policy_item("per-key", limit(10, 1000, 3));
    assert_eq!(text(item).as_deref(), Some("\"per-key\";q=10;w=1"));
}

proptest! {
    #[test]
    fn quota_is_honest(
        tokens in 1..=u32::MAX,
        interval_ms in prop_oneof![1..=100_000u64, 1..=(1u64 << 42)],
        burst in 1..=u32::MAX,
    ) {
        let Ok(l) = Limit::new(tokens, Duration::from_millis(interval_ms))
            .and_then(|l| l.with_burst(burst))
        else {
            return Ok(());
        };
        let (q, w) = quota(l);
        prop_assert!(w >= 1 && w * 1000 >= millis(l.refill_time()));
        // Not a second more than needed.
        prop_assert!((w - 1) * 1000 < millis(l.refill_time()).max(1));
        prop_assert!(q >= u64::from(l.burst()));
        // `q` per `w` is at most the rate, and less than one token under it.
        let rate_times_w = u128::from(tokens) * u128::from(w) * 1000;
        prop_assert!(u128::from(q) * u128::from(interval_ms) <= rate_times_w);
        prop_assert!(rate_times_w < (u128::from(q) + 1) * u128::from(interval_ms));
        prop_assert!(q <= MAX_INTEGER);
    }
}

#[test]
fn draft10s_t_is_zero_only_for_a_full_bucket() {
    let l = limit(10, 1000, 3);
    // Full: nothing to wait for.
    assert_eq!(next_token_ms(l, 3, 0), 0);
    assert_eq!(next_token_ms(l, 3, 100), 0);
    // Not full, however little is missing: at least a millisecond, so t is at least 1.
    assert_eq!(next_token_ms(l, 2, 1), 1);
    assert_eq!(next_token_ms(l, 0, 1), 1);
    // The first request leaves 2 and a bucket refilling: the next token in 100 ms, t=1.
    let (d, _) = after(l, 0, 0);
    let item = Item::admitted("per-key", &d);
    assert_eq!(
        (item.remaining, item.next_ms, item.next_secs()),
        (2, 100, 1)
    );
    // Empty: the next token 100 ms after the third request.
    let (d, _) = after(l, 2, 0);
    let item = Item::admitted("per-key", &d);
    assert_eq!((item.remaining, item.next_ms), (0, 100));
    // 30 ms later, 70 ms to go, and a fraction of a token in the bucket.
    let (d, _) = after(l, 2, 30);
    assert_eq!(d.remaining(), 0);
    assert_eq!(Item::admitted("per-key", &d).next_ms, 70);
    // "1/min burst 10", two taken at once: 8 left, and the next token in a minute.
    let l = limit(1, 60_000, 10);
    let (d, _) = after(l, 1, 0);
    let item = Item::admitted("orders", &d);
    assert_eq!((item.remaining, item.next_secs()), (8, 60));
    // Twenty seconds on, the fraction refilled counts: 40 s to the next token.
    let (d, _) = after(l, 1, 20_000);
    let item = Item::admitted("orders", &d);
    assert_eq!((item.remaining, item.next_secs()), (8, 40));
    // Emptied: every request refused until the next token, which the item names.
    let (d, _) = after(l, 10, 15_000);
    assert!(!d.is_admitted());
    let item = Item::denied("orders", &d);
    assert_eq!(
        (item.remaining, item.next_ms, item.retry_ms),
        (0, 45_000, 45_000)
    );
    for version in [FieldVersion::Draft11, FieldVersion::Draft10] {
        let r = ratelimit(version, [item].into_iter());
        assert_eq!(text(r).as_deref(), Some("\"orders\";r=0;t=45"));
    }
}

#[test]
fn draft11s_t_is_the_effective_window_never_zero() {
    // "10/s burst 3", full: 3 may go now, and one token period (100 ms) after the first of
    // them the bucket holds a token again. Draft 10 says 0: no more quota is coming while full.
    let l = limit(10, 1000, 3);
    let full = Item::refunded("per-key", &after(l, 0, 0).0, 1);
    assert_eq!((full.remaining, full.next_ms), (3, 0));
    assert_eq!(
        (full.window_ms(), full.window_secs(), full.next_secs()),
        (100, 1, 0)
    );
    assert_eq!(full.t_secs(FieldVersion::Draft11), 1);
    assert_eq!(full.t_secs(FieldVersion::Draft10), 0);
    let one = |version| text(ratelimit(version, [full].into_iter()));
    assert_eq!(
        one(FieldVersion::Draft11).as_deref(),
        Some("\"per-key\";r=3;t=1")
    );
    assert_eq!(
        one(FieldVersion::Draft10).as_deref(),
        Some("\"per-key\";r=3;t=0")
    );
    // "1/min burst 10", full: a minute. "3/1500ms": 500 ms, one second once rounded up.
    let l = limit(1, 60_000, 10);
    let full = Item::refunded("orders", &after(l, 0, 0).0, 1);
    assert_eq!((full.remaining, full.window_secs()), (10, 60));
    let l = limit(3, 1500, 3);
    let full = Item::refunded("x", &after(l, 0, 0).0, 1);
    assert_eq!((full.window_ms(), full.window_secs()), (500, 1));
    // Not full: the next token, in both drafts.
    let (d, _) = after(limit(1, 60_000, 10), 1, 20_000);
    let item = Item::admitted("orders", &d);
    assert_eq!((item.window_secs(), item.next_secs()), (40, 40));
    // The slowest limit's window stays an sf-integer.
    let l = limit(1, 1 << 42, 1);
    let full = Item::refunded("slow", &after(l, 0, 0).0, 1);
    assert_eq!(full.window_secs(), (1u64 << 42).div_ceil(1000));
}

#[test]
fn a_denied_items_t_is_the_next_token_and_its_reset_the_retry() {
    // Cost 3 with 1 token left: the next token in 100 ms, the cost served in 200 ms.
    let l = limit(10, 1000, 3);
    let (_, state) = decide(l, None, 0, 2, 0);
    let (d, _) = decide(l, state, 0, 3, 0);
    assert!(!d.is_admitted());
    let item = Item::denied("per-key", &d);
    assert_eq!((item.remaining, item.next_ms, item.retry_ms), (1, 100, 200));
    // A reservation in debt: the next whole token after the debt is paid.
    let (_, state) = decide(l, None, 0, 3, 0);
    let (d, _) = decide(l, state, 0, 2, 1000);
    assert_eq!(
        (d.is_admitted(), d.wait()),
        (true, Duration::from_millis(200))
    );
    let item = Item::admitted("per-key", &d);
    assert_eq!((item.remaining, item.next_ms), (0, 300));
}

#[test]
fn a_refund_gives_back_tokens_and_keeps_the_next_token_where_it_was() {
    let l = limit(10, 1000, 3);
    let (d, _) = after(l, 1, 30);
    let admitted = Item::admitted("per-key", &d);
    assert_eq!((admitted.remaining, admitted.next_ms), (1, 70));
    let refunded = Item::refunded("per-key", &d, 1);
    assert_eq!((refunded.remaining, refunded.next_ms), (2, 70));
    // Back to full: t=0.
    let (d, _) = after(l, 0, 0);
    let refunded = Item::refunded("per-key", &d, 1);
    assert_eq!((refunded.remaining, refunded.next_ms), (3, 0));
    // A reservation's item is the store's.
    let (_, state) = decide(l, None, 0, 3, 0);
    let (d, _) = decide(l, state, 0, 1, 1000);
    let refunded = Item::refunded("per-key", &d, 1);
    assert_eq!((refunded.remaining, refunded.next_ms), (0, 200));
}

#[test]
fn a_requests_policy_is_prebuilt_unless_a_dynamic_limit_is_not_its_rules_own() {
    let rules = [
        ("per-key", limit(10, 1000, 10)),
        ("orders", limit(1, 60_000, 10)),
    ];
    let items: Vec<HeaderValue> = rules
        .iter()
        .filter_map(|&(name, own)| policy_item(name, own))
        .collect();
    let all = policy(items.iter());
    let of = |any_dynamic, applied: &[(usize, Limit)]| {
        let applied = applied.iter().map(|&(i, limit)| Applied {
            item: &items[i],
            name: rules[i].0,
            own: rules[i].1,
            limit,
        });
        text(policy_for(all.as_ref(), rules.len(), any_dynamic, applied))
    };
    let both = "\"per-key\";q=10;w=1, \"orders\";q=10;w=600";
    for any_dynamic in [false, true] {
        assert_eq!(
            of(any_dynamic, &[(0, rules[0].1), (1, rules[1].1)]).as_deref(),
            Some(both)
        );
        assert_eq!(
            of(any_dynamic, &[(1, rules[1].1)]).as_deref(),
            Some("\"orders\";q=10;w=600")
        );
        assert!(of(any_dynamic, &[]).is_none());
    }
    // A dynamic limit other than its rule's own: that item is built afresh.
    let other = limit(1, 60_000, 1);
    assert_eq!(
        of(true, &[(0, rules[0].1), (1, other)]).as_deref(),
        Some("\"per-key\";q=10;w=1, \"orders\";q=1;w=60")
    );
}

#[test]
fn named_fields_follow_the_drafts() {
    let a = limit(10, 1000, 10);
    let b = limit(1, 60_000, 10);
    let items = [policy_item("per-key", a), policy_item("orders", b)];
    let items: Vec<HeaderValue> = items.into_iter().flatten().collect();
    let p = policy(items.iter());
    assert_eq!(
        text(p).as_deref(),
        Some("\"per-key\";q=10;w=1, \"orders\";q=10;w=600")
    );
    assert_eq!(policy(items[1..].iter()).as_ref(), Some(&items[1]));
    assert!(policy(std::iter::empty()).is_none());
    let (da, _) = after(a, 6, 0);
    let (db, _) = after(b, 0, 0);
    // "orders" is full again after a refund: the drafts differ there only.
    let views = || {
        [
            Item::admitted("per-key", &da),
            Item::refunded("orders", &db, 1),
        ]
        .into_iter()
    };
    for (version, want) in [
        (
            FieldVersion::Draft11,
            "\"per-key\";r=3;t=1, \"orders\";r=10;t=60",
        ),
        (
            FieldVersion::Draft10,
            "\"per-key\";r=3;t=1, \"orders\";r=10;t=0",
        ),
    ] {
        let out = fields(version, || policy(items.iter()), views());
        let mut headers = HeaderMap::new();
        out.expect("fields").insert_into(&mut headers);
        assert_eq!(
            headers.get(&RATELIMIT).and_then(|v| v.to_str().ok()),
            Some(want)
        );
        assert_eq!(
            headers.get(&RATELIMIT_POLICY),
            policy(items.iter()).as_ref()
        );
        assert_eq!(headers.len(), 2);
    }
    assert_eq!(FieldVersion::default(), FieldVersion::Draft11);
    // One rule's field is written by a path of its own: the same text.
    let one = ratelimit(
        FieldVersion::Draft11,
        [Item::admitted("orders", &db)].into_iter(),
    );
    assert_eq!(text(one).as_deref(), Some("\"orders\";r=9;t=60"));
    let (first, _) = after(a, 0, 0);
    let one = ratelimit(
        FieldVersion::Draft11,
        [Item::admitted("per-key", &first)].into_iter(),
    );
    assert_eq!(text(one).as_deref(), Some("\"per-key\";r=9;t=1"));
}

#[test]
fn an_items_partition_is_its_keys_fingerprint_never_the_key() {
    let l = limit(10, 1000, 3);
    let (d, _) = after(l, 0, 0);
    let key = BucketKey::new("per-key", "sk_live_secret").expect("a key");
    let other = BucketKey::new("per-key", "another client").expect("a key");
    // The fingerprint's bytes. Another test may change the process's fingerprint key meanwhile:
    // a reading taken between two equal ones is under the key both were.
    let item = loop {
        let before = key.fingerprint_bytes();
        let item = Item::admitted("per-key", &d).partition(&key);
        if key.fingerprint_bytes() == before {
            assert_eq!(item.partition, Some(before));
            break item;
        }
    };
    let second = Item::admitted("global", &d).partition(&other);
    let pk_of = |entry: &ListEntry| match entry {
        ListEntry::Item(i) => i
            .params
            .get("pk")
            .and_then(|v| v.as_byte_sequence())
            .map(<[u8]>::to_vec),
        ListEntry::InnerList(_) => None,
    };
    for version in [FieldVersion::Draft11, FieldVersion::Draft10] {
        // The one-rule path and the general one write the same item.
        let one = ratelimit(version, [item].into_iter()).expect("a field");
        let two = ratelimit(version, [item, second].into_iter()).expect("a field");
        for field in [&one, &two] {
            let text = field.to_str().expect("ASCII");
            assert!(
                !text.contains("secret") && !text.contains("another"),
                "{text}"
            );
            // A Byte Sequence holding the fingerprint's bytes.
            let parsed: sfv::List = Parser::new(field.as_bytes()).parse().expect("a list");
            assert_eq!(pk_of(&parsed[0]), item.partition.map(Vec::from), "{text}");
        }
        assert!(
            one.to_str()
                .is_ok_and(|t| t.starts_with("\"per-key\";r=2;t=1;pk=:") && t.ends_with(':')),
            "{one:?}"
        );
        let parsed: sfv::List = Parser::new(two.as_bytes()).parse().expect("a list");
        assert_eq!(pk_of(&parsed[1]), second.partition.map(Vec::from));
    }
    // Base64 of six bytes, two groups of three, no padding.
    assert_eq!(&partition_key([0, 0, 0, 0xff, 0xff, 0xff]), b"AAAA////");
    assert_eq!(&partition_key(*b"burstg"), b"YnVyc3Rn");
}

#[test]
fn draft06_fields_describe_the_limit_closest_to_exhaustion() {
    let a = limit(10, 1000, 3);
    let b = limit(1, 60_000, 10);
    let (da, _) = after(a, 1, 0);
    let (db, _) = after(b, 7, 0);
    let items = || {
        [
            Item::admitted("per-key", &da),
            Item::admitted("orders", &db),
        ]
    };
    let called = std::cell::Cell::new(false);
    let policy = || {
        called.set(true);
        None
    };
    let out = fields(FieldVersion::Draft06, policy, items().into_iter());
    assert!(
        !called.get(),
        "the named formats' policy is not built for draft 06"
    );
    let mut headers = HeaderMap::new();
    out.expect("fields").insert_into(&mut headers);
    let get = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    // "per-key" has 1 left, "orders" 2: "per-key" is closest.
    assert_eq!(get(&RATELIMIT_LIMIT), Some("10"));
    assert_eq!(get(&RATELIMIT_REMAINING), Some("1"));
    assert_eq!(get(&RATELIMIT_RESET), Some("1"));
    assert_eq!(get(&RATELIMIT_POLICY), Some("10;w=1"));
    assert_eq!(get(&RATELIMIT), None);
    assert_eq!(headers.len(), 4);
    // On a refusal, the refusing rule, with the reset at its retry.
    let (_, state) = decide(a, None, 0, 2, 0);
    let (denied, _) = decide(a, state, 0, 3, 0);
    let (db, _) = after(b, 0, 0);
    let out = fields(
        FieldVersion::Draft06,
        || None,
        [
            Item::refunded("orders", &db, 1),
            Item::denied("per-key", &denied),
        ]
        .into_iter(),
    );
    let mut headers = HeaderMap::new();
    out.expect("fields").insert_into(&mut headers);
    let get = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    assert_eq!(get(&RATELIMIT_REMAINING), Some("1"));
    assert_eq!(get(&RATELIMIT_RESET), Some("1"));
    assert_eq!(get(&RATELIMIT_LIMIT), Some("10"));
    // Ties go to the later reset.
    let (d1, _) = after(a, 2, 0);
    let (d2, _) = after(b, 9, 0);
    let picked = fields(
        FieldVersion::Draft06,
        || None,
        [
            Item::admitted("per-key", &d1),
            Item::admitted("orders", &d2),
        ]
        .into_iter(),
    );
    assert!(
        matches!(picked, Some(Fields::Draft06 { reset_secs: 60, .. })),
        "{picked:?}"
    );
    assert!(fields(FieldVersion::Draft06, || None, std::iter::empty()).is_none());
}

/// An item's bare value and its parameters, each an Integer.
type Parsed = (BareItem, Vec<(String, i64)>);

/// A list of items with Integer parameters, as `sfv` parses it.
fn parse_list(v: &HeaderValue) -> Result<Vec<Parsed>, String> {
    let list: sfv::List = Parser::new(v.as_bytes())
        .parse()
        .map_err(|e| format!("{v:?} is not a list: {e}"))?;
    list.into_iter()
        .map(|entry| match entry {
            ListEntry::Item(item) => {
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| match v.as_integer() {
                        Some(n) => Ok((k.as_str().to_owned(), i64::from(n))),
                        None => Err(format!("parameter {k:?} of {v:?} is no integer")),
                    })
                    .collect::<Result<_, _>>()?;
                Ok((item.bare_item, params))
            }
            ListEntry::InnerList(_) => Err(format!("{v:?} has an inner list")),
        })
        .collect()
}

fn parse_integer(v: Option<&HeaderValue>) -> Option<i64> {
    let item: sfv::Item = Parser::new(v?.as_bytes()).parse().ok()?;
    if !item.params.is_empty() {
        return None;
    }
    item.bare_item.as_integer().map(i64::from)
}

fn string(name: &str) -> BareItem {
    BareItem::String(sfv::String::from_string(name.to_owned()).expect("a valid string"))
}

fn int(n: u64) -> i64 {
    i64::try_from(n).expect("within an sf-integer")
}

/// A limit's parts, from common to extreme.
fn limits() -> impl Strategy<Value = Limit> {
    (
        prop_oneof![1..=100u32, 1..=u32::MAX],
        prop_oneof![
            1..=100_000u64,
            (1..=48u64).prop_map(|h| h * 3_600_000),
            1..=(1u64 << 42)
        ],
        prop_oneof![1..=100u32, 1..=u32::MAX],
    )
        .prop_filter_map("a valid limit", |(t, i, b)| {
            Limit::new(t, Duration::from_millis(i))
                .and_then(|l| l.with_burst(b))
                .ok()
        })
}

/// One rule: a bucket name by the naming rule, its limit, how many requests were taken at
/// 0 ms, when the next came, and what it cost.
fn rule() -> impl Strategy<Value = (String, Limit, u32, u64, u32)> {
    (
        "[A-Za-z0-9_.-]{1,64}",
        limits(),
        0..12u32,
        0..200_000u64,
        1..5u32,
    )
}

proptest! {
    /// Every shape either format writes is what RFC 9651 parses back to the items and
    /// parameters meant: names, quotas, windows, remaining tokens and seconds.
    #[test]
    fn fields_parse_back_as_structured_fields(
        rules in prop::collection::vec(rule(), 1..5),
        refused in any::<bool>(),
    ) {
        let mut items = Vec::new();
        let mut policies = Vec::new();
        let mut want_policy = Vec::new();
        let count = rules.len();
        for (n, (name, l, taken, at, cost)) in rules.iter().enumerate() {
            let cost = (*cost).min(l.burst());
            let mut state = None;
            for _ in 0..(*taken).min(l.burst()) {
                state = decide(*l, state, 0, 1, 0).1;
            }
            let (d, _) = decide(*l, state, *at, cost, 0);
            let last = n + 1 == count;
            items.push(match (refused, last, d.is_admitted()) {
                (true, true, false) => Item::denied(name, &d),
                (true, false, true) => Item::refunded(name, &d, cost),
                _ => Item::admitted(name, &d),
            });
            policies.push(policy_item(name, *l).expect("a policy item"));
            let (q, w) = quota(*l);
            want_policy.push((string(name), vec![("q".into(), int(q)), ("w".into(), int(w))]));
        }
        let want_items = |t: fn(&Item<'_>) -> u64| -> Vec<Parsed> {
            items
                .iter()
                .map(|i| {
                    let params = vec![
                        ("r".to_owned(), i64::from(i.remaining)),
                        ("t".to_owned(), int(t(i))),
                    ];
                    (string(i.name), params)
                })
                .collect()
        };
        let closest = items
            .iter()
            .min_by_key(|i| (i.remaining, std::cmp::Reverse(i.reset_secs())))
            .map(|i| (quota(i.limit), i.remaining, i.reset_secs()));
        let views = || items.iter().copied();

        let draft11: fn(&Item<'_>) -> u64 = |i| {
            if i.next_ms == 0 {
                // A full bucket: one token period.
                i.limit.interval_ms().div_ceil(u64::from(i.limit.tokens())).div_ceil(1000)
            } else {
                i.next_ms.div_ceil(1000)
            }
        };
        let draft10: fn(&Item<'_>) -> u64 = |i| i.next_ms.div_ceil(1000);
        for (version, t) in [(FieldVersion::Draft11, draft11), (FieldVersion::Draft10, draft10)] {
            let mut headers = HeaderMap::new();
            fields(version, || policy(policies.iter()), views())
                .expect("fields")
                .insert_into(&mut headers);
            let p = headers.get(&RATELIMIT_POLICY).expect("a policy");
            prop_assert_eq!(parse_list(p).map_err(TestCaseError::fail)?, want_policy.clone());
            let r = headers.get(&RATELIMIT).expect("a RateLimit field");
            prop_assert_eq!(parse_list(r).map_err(TestCaseError::fail)?, want_items(t));
        }

        let mut headers = HeaderMap::new();
        fields(FieldVersion::Draft06, || None, views())
            .expect("fields")
            .insert_into(&mut headers);
        let ((q, w), remaining, reset) = closest.expect("an item");
        prop_assert_eq!(parse_integer(headers.get(&RATELIMIT_LIMIT)), Some(int(q)));
        prop_assert_eq!(
            parse_integer(headers.get(&RATELIMIT_REMAINING)),
            Some(i64::from(remaining))
        );
        prop_assert_eq!(parse_integer(headers.get(&RATELIMIT_RESET)), Some(int(reset)));
        let p = headers.get(&RATELIMIT_POLICY).expect("a policy");
        let want = vec![(BareItem::Integer(sfv::Integer::constant(int(q))), vec![("w".to_owned(), int(w))])];
        prop_assert_eq!(parse_list(p).map_err(TestCaseError::fail)?, want);
    }

    /// A request of cost 1 refused waits for the next token: its item's `t` is the
    /// `Retry-After` the rejection sends, and a larger cost's `t` is no later than it.
    #[test]
    fn a_refusals_t_never_names_a_time_after_its_retry(
        l in limits(),
        later in 0.0..1.0f64,
        cost in 1..5u32,
    ) {
        // Emptied at 0 ms, then asked again at some time before the cost has refilled.
        let cost = cost.min(l.burst());
        let (_, state) = decide(l, None, 0, l.burst(), 0);
        let (first, _) = decide(l, state, 0, cost, 0);
        let at = (millis(first.wait()) as f64 * later) as u64;
        let (d, _) = decide(l, state, at, cost, 0);
        prop_assert!(!d.is_admitted());
        let item = Item::denied("x", &d);
        let retry_after = ceil_secs(d.wait()).max(1);
        prop_assert!(item.next_secs() >= 1 && item.next_secs() <= retry_after);
        // Draft 11: Retry-After names no time before the end of the effective window.
        prop_assert_eq!(item.window_secs(), item.next_secs());
        prop_assert_eq!(item.reset_secs(), retry_after);
        if cost == 1 {
            prop_assert_eq!(item.next_secs(), retry_after);
        }
    }

    /// `t` comes from the millisecond the next whole token is in the bucket, give or take
    /// one, and is zero only when the bucket is full.
    #[test]
    fn the_next_token_is_where_t_says(
        l in limits(),
        taken in 0..12u32,
        at in 0..200_000u64,
    ) {
        let p = Params::of(&l);
        let mut state = None;
        for _ in 0..taken.min(l.burst()) {
            state = decide(l, state, 0, 1, 0).1;
        }
        let (d, state) = decide(l, state, at, 1, 0);
        let item = Item::admitted("x", &d);
        let held = |ms: u64| bucket::peek(&p, state, at + ms).remaining;
        if item.next_ms == 0 {
            prop_assert_eq!(u64::from(d.remaining()), u64::from(l.burst()));
            prop_assert_eq!(held(0), u64::from(l.burst()));
        } else {
            prop_assert!(u64::from(d.remaining()) < u64::from(l.burst()));
            // The store's floating-point bucket may reach the token a millisecond after the
            // exact time.
            prop_assert!(held(item.next_ms + 1) > u64::from(d.remaining()), "{} early", item.next_ms);
            if item.next_ms >= 2 {
                prop_assert_eq!(held(item.next_ms - 2), u64::from(d.remaining()));
            }
        }
    }

    /// Draft 11's `t`: a client that spends the `r` tokens it is told of at once holds none
    /// until the effective window ends, and holds a token again when it does (give or take
    /// the store's millisecond), full bucket or not.
    #[test]
    fn the_effective_window_ends_when_a_token_is_back(
        l in limits(),
        taken in 0..12u32,
        at in 0..200_000u64,
        refund in any::<bool>(),
    ) {
        let p = Params::of(&l);
        let mut state = None;
        for _ in 0..taken.min(l.burst()) {
            state = decide(l, state, 0, 1, 0).1;
        }
        let (d, mut state) = decide(l, state, at, 1, 0);
        let mut item = Item::admitted("x", &d);
        if refund && d.is_admitted() {
            // The token given back, as the layer does when a later rule refuses.
            let (_, write) = bucket::refund(&p, state, at, 1.0, at);
            state = write.map(|w| w.state).or(state);
            item = Item::refunded("x", &d, 1);
        }
        prop_assert_eq!(bucket::peek(&p, state, at).remaining, u64::from(item.remaining));
        let window = item.window_ms();
        prop_assert!(window >= 1 && item.window_secs() >= 1);
        if item.remaining > 0 {
            state = decide(l, state, at, item.remaining, 0).1;
        }
        let held = |ms: u64| bucket::peek(&p, state, at + ms).remaining;
        prop_assert!(held(window + 1) >= 1, "no token {} ms on", window);
        if window >= 2 {
            prop_assert_eq!(held(window - 2), 0);
        }
    }
}
