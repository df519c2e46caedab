//! Every key matching a pattern, through `SCAN` (never `KEYS`, which real servers often forbid),
//! sorted. Shared by the tests that check exactly what reached Redis.

use redis::aio::ConnectionLike;

/// The keys matching `pattern`, sorted. Panics if Redis refuses `SCAN`.
pub async fn keys_matching(conn: &mut impl ConnectionLike, pattern: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys
}
