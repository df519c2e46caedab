//! The wire format against hand-made replies and values: what each reply means, and which are
//! refused. The helpers marked `pub(in crate::store::redis)` serve `raw.rs`'s test too.

use super::*;

fn packed(numbers: [f64; 5], tail: &[u8]) -> Value {
    let mut bytes: Vec<u8> = numbers.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend_from_slice(tail);
    Value::BulkString(bytes)
}

pub(in crate::store::redis) const NOW: u64 = 1_700_000_000_000;

/// An acquire of 1 on 10 per second, burst 10.
pub(in crate::store::redis) fn acquire() -> Args {
    Args {
        op: Op::Acquire,
        limit: Limit::per_second(10).expect("a limit"),
        x: 1,
        max_wait: 0,
    }
}

/// Whether the reply to a call made with `args` at `NOW` is refused as a backend error.
fn refused(value: &Value, args: &Args) -> bool {
    matches!(parse_reply(value, args, NOW), Err(StoreError::Backend(_)))
}

pub(in crate::store::redis) fn state(t: f64, ts: f64) -> Value {
    let keep = ts + 60_000.0;
    Value::BulkString([t.to_le_bytes(), ts.to_le_bytes(), keep.to_le_bytes()].concat())
}

#[test]
fn an_admission_with_no_wait_is_worked_out_from_the_state_it_stored() {
    // 9.5 tokens stored at now: 9 whole left, and the half token missing refills in 50 ms.
    let admit = parse_reply(&state(9.5, NOW as f64), &acquire(), NOW).expect("parses");
    let expected = Verdict {
        allowed: true,
        wait: 0,
        remaining: 9,
        reset: 50,
        at: NOW,
    };
    assert_eq!(
        admit,
        Reply {
            outcome: expected,
            state: Some(State {
                t: 9.5,
                ts: NOW as f64
            }),
            halt: 0,
        }
    );
    // Stored ahead of this process's clock (another's ran ahead): reset counts from the
    // stored time, where this caller is taken to stand.
    let ahead = parse_reply(&state(10.0, (NOW + 30) as f64), &acquire(), NOW).expect("parses");
    assert_eq!(ahead.outcome.reset, 0);
    assert_eq!(ahead.outcome.remaining, 10);
}

#[test]
fn a_stored_state_no_plain_admission_could_leave_is_a_backend_error() {
    let bad = [
        state(-0.5, NOW as f64),
        state(10.5, NOW as f64),
        state(f64::NAN, NOW as f64),
        state(-f64::INFINITY, NOW as f64),
        state(1.0, (NOW - 1) as f64),
        state(1.0, NOW as f64 + 0.5),
        state(1.0, f64::INFINITY),
        state(1.0, 9_007_199_254_740_992.0),
    ];
    for value in bad {
        assert!(refused(&value, &acquire()), "{value:?}");
    }
    // A denial's stored value must be one the script could have written.
    for (t, ts) in [
        (-1e300, NOW as f64),
        (f64::NAN, NOW as f64),
        (11.0, NOW as f64),
        (1.0, -1.0),
        (1.0, 0.5),
    ] {
        let Value::BulkString(carried) = state(t, ts) else {
            unreachable!("state() makes a bulk string")
        };
        let denial = packed([0.0, 100.0, 0.0, 100.0, NOW as f64], &carried);
        assert!(refused(&denial, &acquire()), "{t} {ts}");
    }
    // Only an acquire answers with the state alone.
    let peek = Args {
        op: Op::Peek,
        ..acquire()
    };
    assert!(refused(&state(1.0, NOW as f64), &peek));
}

#[test]
fn an_admission_and_a_denial_with_its_state_parse() {
    let admit = parse_reply(
        &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], b""),
        &acquire(),
        NOW,
    )
    .expect("parses");
    assert_eq!(
        admit,
        Reply {
            outcome: Verdict {
                allowed: true,
                wait: 0,
                remaining: 9,
                reset: 1500,
                at: NOW
            },
            state: None,
            halt: 0,
        }
    );
    let mut state = 0.25f64.to_le_bytes().to_vec();
    state.extend_from_slice(&1_700_000_000_123f64.to_le_bytes());
    state.extend_from_slice(&1_700_003_600_123f64.to_le_bytes());
    let deny = parse_reply(
        &packed(
            [0.0, 250.0, 0.0, 9_007_199_254_740_991.0, NOW as f64],
            &state,
        ),
        &acquire(),
        NOW,
    )
    .expect("parses");
    assert!(!deny.outcome.allowed);
    assert_eq!(deny.outcome.wait, 250);
    assert_eq!(deny.outcome.reset, 9_007_199_254_740_991);
    assert_eq!(
        deny.state,
        Some(State {
            t: 0.25,
            ts: 1_700_000_000_123.0
        })
    );
}

/// The stored value alone, in an array: a denial with no wait allowed.
pub(in crate::store::redis) fn denial_of(t: f64, ts: f64) -> Value {
    Value::Array(vec![state(t, ts)])
}

#[test]
fn a_denial_with_no_wait_is_worked_out_from_the_value_it_read() {
    // 0.25 tokens at now, 10 per second: the missing 0.75 refill in 75 ms, the rest of the
    // bucket (9.75) in 975 ms.
    let deny = parse_reply(&denial_of(0.25, NOW as f64), &acquire(), NOW).expect("parses");
    assert_eq!(
        deny,
        Reply {
            outcome: Verdict {
                allowed: false,
                wait: 75,
                remaining: 0,
                reset: 975,
                at: NOW
            },
            state: Some(State {
                t: 0.25,
                ts: NOW as f64
            }),
            halt: 0,
        }
    );
    // In debt from a reservation, stored ahead of this process's clock: counted from the
    // stored time.
    let deny = parse_reply(&denial_of(-2.0, (NOW + 40) as f64), &acquire(), NOW).expect("parses");
    assert_eq!((deny.outcome.wait, deny.outcome.reset), (300, 1200));
}

#[test]
fn a_value_the_arithmetic_would_not_deny_on_is_a_backend_error() {
    // A whole token stored: an acquire of 1 goes now, so no script denies on it.
    assert!(refused(&denial_of(1.0, NOW as f64), &acquire()));
    // Nor after a stored time long enough ago to refill one.
    assert!(refused(&denial_of(0.0, (NOW - 100) as f64), &acquire()));
    // Only an acquire that may not wait is denied this way.
    let waits = Args {
        max_wait: 1,
        ..acquire()
    };
    assert!(refused(&denial_of(0.0, NOW as f64), &waits));
    let peek = Args {
        op: Op::Peek,
        ..acquire()
    };
    assert!(refused(&denial_of(0.0, NOW as f64), &peek));
    // A value no script could have stored, or not a value at all.
    for bad in [
        denial_of(-1e300, NOW as f64),
        denial_of(0.0, NOW as f64 + 0.5),
        Value::Array(vec![]),
        Value::Array(vec![state(0.0, NOW as f64), state(0.0, NOW as f64)]),
        Value::Array(vec![Value::BulkString(vec![0; 16])]),
        Value::Array(vec![Value::Nil]),
    ] {
        assert!(refused(&bad, &acquire()), "{bad:?}");
    }
}

#[test]
fn a_halted_value_and_a_peek_with_its_halt_parse() {
    // An admission's stored value with a halt after it: the state is the same.
    let Value::BulkString(mut bytes) = state(9.5, NOW as f64) else {
        unreachable!("state() makes a bulk string")
    };
    bytes.extend_from_slice(&((NOW + 2_000) as f64).to_le_bytes());
    assert_eq!(decode_halt(&bytes), Some((NOW + 2_000) as f64));
    let admit = parse_reply(&Value::BulkString(bytes.clone()), &acquire(), NOW).expect("parses");
    assert_eq!(admit.state.map(|s| s.t), Some(9.5));
    // A denial carrying it.
    let denial = Value::Array(vec![Value::BulkString(bytes)]);
    assert!(
        parse_reply(&denial, &acquire(), NOW).is_err(),
        "9.5 tokens admit"
    );
    let peek = Args {
        op: Op::Peek,
        ..acquire()
    };
    let halt = ((NOW + 2_000) as f64).to_le_bytes();
    let reply = parse_reply(
        &packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &halt),
        &peek,
        NOW,
    )
    .expect("parses");
    assert_eq!(reply.halt, NOW + 2_000);
    // A peek always carries a halt, whole and in range; nothing else carries one.
    for bad in [
        packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], b""),
        packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &0.5f64.to_le_bytes()),
        packed(
            [0.0, 100.0, 0.0, 1000.0, NOW as f64],
            &(-1.0f64).to_le_bytes(),
        ),
        packed(
            [0.0, 100.0, 0.0, 1000.0, NOW as f64],
            &f64::NAN.to_le_bytes(),
        ),
    ] {
        assert!(refused(&bad, &peek), "{bad:?}");
    }
    assert!(refused(
        &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], &halt),
        &acquire()
    ));
}

#[test]
fn the_key_written_into_a_command_is_the_key_named() {
    assert_eq!(FORMAT_PART, format!(":v{FORMAT}:"));
    let key = BucketKey::new("orders", "seller:{7}").expect("a key");
    let redis_key = RedisKey {
        prefix: "app",
        key: &key,
    };
    let cmd = command("EVALSHA", "sha", redis_key, &[7; PACKED_ARGS]);
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => bytes,
            _ => b"<not a plain argument>",
        })
        .collect();
    let named = redis_key.to_string();
    assert_eq!(
        args,
        [
            b"EVALSHA".as_slice(),
            b"sha",
            b"1",
            named.as_bytes(),
            &[7; PACKED_ARGS]
        ]
    );
    assert_eq!(named, "app:v4:orders:{seller%3A%7B7%7D}");
}

/// One bucket's answer to a call on several: the five numbers and the state.
fn each(numbers: [f64; 5], t: f64, ts: f64) -> Vec<u8> {
    numbers
        .iter()
        .chain([&t, &ts])
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

#[test]
fn a_reply_on_several_buckets_carries_each_state_or_none() {
    let limit = Limit::per_second(10).expect("a limit");
    let (a, b) = (
        BucketKey::new("a", "k").expect("a key"),
        BucketKey::new("b", "k").expect("a key"),
    );
    let takes = [Take::new(&a, limit, 1), Take::new(&b, limit, 1)];
    let now = NOW as f64;
    // Denied: the first bucket in debt since 40 ms ago, the second holding nothing.
    let denial = [
        each([0.0, 140.0, 0.0, 1140.0, now], -1.0, now - 40.0),
        each([0.0, 0.0, 10.0, 0.0, now], 10.0, -1.0),
    ]
    .concat();
    let parsed = parse_all(&Value::BulkString(denial), &takes).expect("parses");
    assert_eq!(
        parsed.iter().map(|e| e.state).collect::<Vec<_>>(),
        [
            Some(State {
                t: -1.0,
                ts: now - 40.0
            }),
            None
        ]
    );
    assert_eq!(parsed[0].outcome.wait, 140);
    // Admitted: both stored at the time the waits count from.
    let admission = [
        each([1.0, 0.0, 4.0, 550.0, now], 4.5, now),
        each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
    ]
    .concat();
    let parsed = parse_all(&Value::BulkString(admission), &takes).expect("parses");
    assert_eq!(parsed[0].state, Some(State { t: 4.5, ts: now }));
    for bad in [
        // An admission with no state, or stored at another time.
        [
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, -1.0),
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        [
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, now - 1.0),
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        // A denial on a state stored after the time its waits count from.
        [
            each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now + 1.0),
            each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        // A state no script reads or stores, and a marker of no state but -1.
        [
            each([0.0, 100.0, 0.0, 1000.0, now], f64::NAN, now),
            each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        [
            each([0.0, 100.0, 0.0, 1000.0, now], -1e300, now),
            each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        [
            each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now - 0.5),
            each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        [
            each([0.0, 100.0, 0.0, 1000.0, now], 10.0, -2.0),
            each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ],
        // One bucket admitted and the other not.
        [
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
            each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now),
        ],
    ] {
        let value = Value::BulkString(bad.concat());
        assert!(
            matches!(parse_all(&value, &takes), Err(StoreError::Backend(_))),
            "{value:?}"
        );
    }
    // The five numbers alone, as before the states: no decision on each bucket.
    let short = Value::BulkString(vec![0; 80]);
    assert!(parse_all(&short, &takes).is_err());
}

#[test]
fn anything_else_is_a_backend_error() {
    let bad = [
        Value::Array(vec![
            Value::Int(1),
            Value::Int(0),
            Value::Int(1),
            Value::Int(1),
        ]),
        Value::Int(1),
        Value::Nil,
        Value::BulkString(vec![0; 16]),
        Value::BulkString(vec![0; 23]),
        Value::BulkString(vec![0; 25]),
        Value::BulkString(vec![0; 31]),
        Value::BulkString(vec![0; 33]),
        Value::BulkString(vec![0; 48]),
        Value::BulkString(vec![0; 55]),
        Value::BulkString(vec![0; 57]),
        packed([2.0, 0.0, 0.0, 0.0, NOW as f64], b""),
        packed([1.0, -1.0, 0.0, 0.0, NOW as f64], b""),
        packed([1.0, 0.5, 0.0, 0.0, NOW as f64], b""),
        packed([1.0, 0.0, f64::NAN, 0.0, NOW as f64], b""),
        packed([1.0, 0.0, 0.0, f64::INFINITY, NOW as f64], b""),
        packed(
            [1.0, 0.0, 0.0, 9_223_372_036_854_775_808.0, NOW as f64],
            b"",
        ),
    ];
    for value in bad {
        assert!(refused(&value, &acquire()), "{value:?}");
    }
}
