//! What a flood from one client costs Redis once the deny cache holds its denial, counted by
//! Redis itself (`INFO commandstats`, the script's `EVALSHA` and `EVAL` calls) on a server of the
//! test's own: one bucket against two taken together, through the store and through the tower
//! layer. Run with `--nocapture` to see the counts.
#![cfg(feature = "redis")]

use std::time::Duration;

use burstgate::{BucketStore, Decision, Limit, ManualClock, RedisStore, Take};
use redis::aio::MultiplexedConnection;

use crate::support::{START, ZERO, calls_of, key, limit, redis_server};

/// Requests in a flood.
const FLOOD: u64 = 2_000;

/// The client's own limit: a token a second, a burst of two, kept in Redis 20 s past its last
/// write (two intervals of 10 s), far longer than a flood takes.
fn per_client() -> Limit {
    limit(10, 10_000, 2)
}

/// A limit over every client that the flood never reaches.
fn over_all() -> Limit {
    limit(10_000, 1_000, 10_000)
}

async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to our redis-server")
}

/// Script calls the server has run so far.
async fn script_calls(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    calls_of(&info, "evalsha") + calls_of(&info, "eval")
}

/// Has the server at `url` load both scripts, with a decision of each on keys of their own: its
/// `EVALSHA` of a script it does not hold yet fails, and is sent again as `EVAL`, which would
/// count two calls for the first decision of a flood.
async fn load_scripts(url: &str) {
    let clock = ManualClock::new(START);
    let store = store(url, &clock).await;
    let (a, b) = (key("warm", "a"), key("warm", "b"));
    let takes = [
        Take::new(&a, per_client(), 1),
        Take::new(&b, per_client(), 1),
    ];
    let _ = store
        .acquire(&a, per_client(), 1, ZERO)
        .await
        .expect("decides");
    let _ = store.acquire_all(&takes, ZERO).await.expect("decides");
}

/// A store on the server at `url`, with keys of its own, deciding at `clock`'s time.
async fn store(url: &str, clock: &ManualClock) -> RedisStore<MultiplexedConnection, ManualClock> {
    RedisStore::new(connect(url).await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock.clone())
}

/// [`FLOOD`] requests on the buckets of `takes`, a millisecond apart from `START`, every seventh
/// willing to wait 300 ms: one bucket through `acquire`, several through `acquire_all`. Each
/// request's decisions.
async fn flood(
    store: &RedisStore<MultiplexedConnection, ManualClock>,
    clock: &ManualClock,
    takes: &[Take<'_>],
) -> Vec<Vec<Decision>> {
    let mut decided = Vec::new();
    for i in 0..FLOOD {
        let max_wait = if i % 7 == 0 {
            Duration::from_millis(300)
        } else {
            ZERO
        };
        let decisions = match takes {
            [one] => vec![
                store
                    .acquire(one.key(), one.limit(), one.cost(), max_wait)
                    .await
                    .expect("decides"),
            ],
            several => store.acquire_all(several, max_wait).await.expect("decides"),
        };
        decided.push(decisions);
        clock.advance(Duration::from_millis(1));
    }
    decided
}

fn admitted(decided: &[Vec<Decision>]) -> usize {
    decided.iter().filter(|d| d[0].is_admitted()).count()
}

#[tokio::test]
async fn several_buckets_ask_the_deny_cache_a_flood_costs_redis_what_one_bucket_costs() {
    // A server of our own, so that every script call it counts is this test's.
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let mut admin = connect(&url).await;
    let own = key("own", "client-7");
    let global = key("global", "all");
    let one = [Take::new(&own, per_client(), 1)];
    let two = [
        Take::new(&own, per_client(), 1),
        Take::new(&global, over_all(), 1),
    ];

    let on = async |takes: &[Take<'_>], cache: bool| {
        let clock = ManualClock::new(START);
        let store = store(&url, &clock).await.deny_cache(cache);
        flood(&store, &clock, takes).await
    };
    load_scripts(&url).await;
    let start = script_calls(&mut admin).await;
    let alone = on(&one, true).await;
    let after_one = script_calls(&mut admin).await;
    let together = on(&two, true).await;
    let after_two = script_calls(&mut admin).await;
    let (calls_one, calls_two) = (after_one - start, after_two - after_one);
    println!(
        "{FLOOD} requests from one client: one bucket {calls_one} script calls, two buckets \
         {calls_two} ({} admitted)",
        admitted(&together)
    );

    // The client's own bucket decides both floods: the burst, a token a second, and the
    // reservations that fit their 300 ms. One bucket costs a call for each admission and one
    // for the denial the cache then keeps.
    assert_eq!(admitted(&alone), admitted(&together));
    assert!(admitted(&alone) >= 4, "{alone:?}");
    assert!(
        calls_one <= admitted(&alone) as u64 + 1,
        "one bucket: {calls_one} calls"
    );
    assert!(
        calls_two <= calls_one + 2,
        "two buckets: {calls_two} calls against {calls_one} for one"
    );

    // Refused here or by Redis, every request gets the very decisions Redis gives on each
    // bucket: the same flood through a store without the cache.
    assert_eq!(on(&two, false).await, together);
    redis_server::kill(server);
}

/// What [`FLOOD`] requests from one client, a millisecond apart, cost the server at `url`
/// through a layer of `rules` on a `RedisStore`: its script calls, and the requests served.
#[cfg(feature = "tower")]
async fn through_layer(
    url: &str,
    admin: &mut MultiplexedConnection,
    rules: Vec<burstgate::layer::Rule>,
) -> (u64, usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burstgate::layer::RateLimitLayer;
    use http::{Request, StatusCode};
    use tower::Layer;

    use crate::support::layer::{API_KEY, call, counting};

    let clock = ManualClock::new(START);
    let layer = rules.into_iter().fold(
        RateLimitLayer::new(store(url, &clock).await),
        |layer, rule| layer.rule(rule),
    );
    let served = Arc::new(AtomicUsize::new(0));
    let mut svc = layer.layer(counting(&served));
    let before = script_calls(admin).await;
    for _ in 0..FLOOD {
        let req = Request::builder()
            .header(&API_KEY, "client-7")
            .body(String::new())
            .expect("a valid request");
        let res = call(&mut svc, req).await;
        assert!(
            [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS].contains(&res.status()),
            "{res:?}"
        );
        clock.advance(Duration::from_millis(1));
    }
    (
        script_calls(admin).await - before,
        served.load(Ordering::SeqCst),
    )
}

#[cfg(feature = "tower")]
#[tokio::test]
async fn a_flood_through_a_per_key_and_a_global_rule_costs_redis_what_one_rule_costs() {
    use burstgate::layer::{KeyExtractor, Rule};

    use crate::support::layer::API_KEY;

    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let mut admin = connect(&url).await;
    let per_key =
        || Rule::new("per-key", per_client(), KeyExtractor::header(API_KEY)).expect("a valid rule");
    let global = Rule::new("global", over_all(), KeyExtractor::global()).expect("a valid rule");
    load_scripts(&url).await;
    let (calls_one, served_one) = through_layer(&url, &mut admin, vec![per_key()]).await;
    let (calls_two, served_two) = through_layer(&url, &mut admin, vec![per_key(), global]).await;
    println!(
        "{FLOOD} requests from one client through the layer: one rule {calls_one} script calls, \
         a per-key and a global rule {calls_two} ({served_two} served)"
    );
    assert_eq!(served_one, served_two);
    assert!(served_one >= 3, "{served_one} served");
    assert!(
        calls_two <= calls_one + 2,
        "two rules: {calls_two} calls against {calls_one} for one"
    );
    redis_server::kill(server);
}
