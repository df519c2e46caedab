//! Draws the README's figure: a fixed-window counter beside the token bucket, for one client that
//! sends as often as it is let through.
//!
//! Both enforce "10 requests per minute". The fixed window counts requests per calendar minute
//! (`INCR` and `PEXPIRE`, the approach the crate replaces); the token bucket is `MemoryStore` on a
//! `ManualClock`, the crate's own arithmetic, with the limit's default burst of 10. The client is
//! idle until 50 s, then asks every 250 ms. The figure plots what each lets through, summed over
//! time, under the most any stretch of time may hold (burst + rate x length, counted from the
//! first request).
//!
//! ```sh
//! cargo run -p burstgate-tools --bin figure > docs/fixed-window-vs-token-bucket.svg
//! ```

use std::error::Error;
use std::fmt::Write as _;
use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};

/// The length of the run (one window boundary), and of a fixed window, in milliseconds.
const RUN_MS: u64 = 115_000;
const WINDOW_MS: u64 = 60_000;
/// Requests per window, and per minute for the bucket.
const LIMIT: u32 = 10;
/// When the client starts asking, and how often it asks.
const FIRST_MS: u64 = 50_000;
const EVERY_MS: u64 = 250;

/// The canvas, and the plot inside it, in SVG units.
const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 340.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 700.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 292.0;
/// The y axis's top, in requests.
const Y_MAX: f64 = 30.0;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let (window, bucket) = admissions().await?;
    print!("{}", svg(&window, &bucket)?);
    Ok(())
}

/// The times (ms) at which each limiter let a request through.
async fn admissions() -> Result<(Vec<u64>, Vec<u64>), Box<dyn Error>> {
    let clock = ManualClock::new(0);
    let store = MemoryStore::new().with_clock(clock.clone());
    let limit = Limit::per_minute(LIMIT)?;
    let key = BucketKey::new("figure", "client")?;
    let (mut window, mut bucket) = (Vec::new(), Vec::new());
    let mut counted = (u64::MAX, 0u32);
    let mut now = FIRST_MS;
    while now < RUN_MS {
        clock.set(now);
        let this_window = now / WINDOW_MS;
        if counted.0 != this_window {
            counted = (this_window, 0);
        }
        if counted.1 < LIMIT {
            counted.1 += 1;
            window.push(now);
        }
        if store
            .acquire(&key, limit, 1, Duration::ZERO)
            .await?
            .is_admitted()
        {
            bucket.push(now);
        }
        now += EVERY_MS;
    }
    Ok((window, bucket))
}

fn x(ms: f64) -> f64 {
    LEFT + (RIGHT - LEFT) * ms / RUN_MS as f64
}

fn y(requests: f64) -> f64 {
    BOTTOM - (BOTTOM - TOP) * requests / Y_MAX
}

/// A step line through the running count of `times`, from the start to the end of the run.
fn steps(times: &[u64]) -> String {
    let mut points = format!("{:.1},{:.1}", x(0.0), y(0.0));
    for (i, &t) in times.iter().enumerate() {
        let t = t as f64;
        let _ = write!(
            points,
            " {:.1},{:.1} {:.1},{:.1}",
            x(t),
            y(i as f64),
            x(t),
            y(i as f64 + 1.0)
        );
    }
    let _ = write!(
        points,
        " {:.1},{:.1}",
        x(RUN_MS as f64),
        y(times.len() as f64)
    );
    points
}

/// The most requests any stretch from the first request to `t` may hold: burst + rate x length.
fn bound_at(ms: u64) -> f64 {
    f64::from(LIMIT) + f64::from(LIMIT) * (ms - FIRST_MS) as f64 / WINDOW_MS as f64
}

/// Requests in the busiest `span` of `times`.
fn busiest(times: &[u64], span: u64) -> usize {
    times
        .iter()
        .map(|&start| {
            times
                .iter()
                .filter(|&&t| t >= start && t < start + span)
                .count()
        })
        .max()
        .unwrap_or(0)
}

fn svg(window: &[u64], bucket: &[u64]) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    )?;
    writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    )?;
    writeln!(
        out,
        r#"<text x="{LEFT}" y="22" font-size="14" font-weight="bold">"10 requests per minute": one client that sends as often as it is let through</text>"#
    )?;
    // Grid and axes.
    for s in (0..=RUN_MS / 1_000).step_by(10) {
        let gx = x((s * 1_000) as f64);
        writeln!(
            out,
            "<line x1=\"{gx:.1}\" y1=\"{TOP}\" x2=\"{gx:.1}\" y2=\"{BOTTOM}\" stroke=\"#eee\"/>"
        )?;
        writeln!(
            out,
            r#"<text x="{gx:.1}" y="{:.1}" text-anchor="middle">{s}</text>"#,
            BOTTOM + 16.0
        )?;
    }
    for r in (0..=Y_MAX as u32).step_by(5) {
        let gy = y(f64::from(r));
        writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{gy:.1}\" x2=\"{RIGHT}\" y2=\"{gy:.1}\" stroke=\"#eee\"/>"
        )?;
        writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{r}</text>"#,
            LEFT - 6.0,
            gy + 4.0
        )?;
    }
    writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds</text>"#,
        (LEFT + RIGHT) / 2.0,
        BOTTOM + 34.0
    )?;
    writeln!(
        out,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">requests let through</text>"#,
        (TOP + BOTTOM) / 2.0
    )?;
    // The windows' boundaries.
    for b in (WINDOW_MS..RUN_MS).step_by(WINDOW_MS as usize) {
        let bx = x(b as f64);
        writeln!(
            out,
            "<line x1=\"{bx:.1}\" y1=\"{TOP}\" x2=\"{bx:.1}\" y2=\"{BOTTOM}\" stroke=\"#999\" stroke-dasharray=\"2 3\"/>"
        )?;
        writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#666\">window boundary</text>",
            bx + 4.0,
            BOTTOM - 6.0
        )?;
    }
    // The bound: burst + rate x length, from the first request.
    writeln!(
        out,
        "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#2a7\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>",
        x(FIRST_MS as f64),
        y(bound_at(FIRST_MS)),
        x(RUN_MS as f64),
        y(bound_at(RUN_MS))
    )?;
    writeln!(
        out,
        "<polyline fill=\"none\" stroke=\"#d33\" stroke-width=\"2\" points=\"{}\"/>",
        steps(window)
    )?;
    writeln!(
        out,
        "<polyline fill=\"none\" stroke=\"#36c\" stroke-width=\"2\" points=\"{}\"/>",
        steps(bucket)
    )?;
    // Legend.
    let legend = [
        (
            "#d33",
            "",
            format!(
                "fixed window: {} in the busiest 15 s",
                busiest(window, 15_000)
            ),
        ),
        (
            "#36c",
            "",
            format!(
                "token bucket, burst 10: {} in the busiest 15 s",
                busiest(bucket, 15_000)
            ),
        ),
        (
            "#2a7",
            "6 4",
            "the most any stretch may hold: burst + rate x length".to_owned(),
        ),
    ];
    for (i, (color, dash, label)) in legend.iter().enumerate() {
        // Above the lines: the plot is empty there.
        let ly = TOP + 14.0 + 18.0 * i as f64;
        let lx = LEFT + 12.0;
        writeln!(
            out,
            "<line x1=\"{lx:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\" stroke-width=\"2\" stroke-dasharray=\"{dash}\"/>",
            ly - 4.0,
            lx + 24.0,
            ly - 4.0
        )?;
        writeln!(
            out,
            r#"<text x="{:.1}" y="{ly:.1}">{label}</text>"#,
            lx + 30.0
        )?;
    }
    writeln!(out, "</svg>")?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_fixed_window_lets_twice_the_limit_through_at_its_boundary_and_the_bucket_does_not()
    {
        let (window, bucket) = admissions().await.expect("runs");
        assert_eq!(busiest(&window, 15_000), 2 * LIMIT as usize);
        // The burst, and the tokens refilled in those 15 s (one every 6 s), at most.
        assert!(busiest(&bucket, 15_000) <= 10 + 15 / 6 + 1);
        for (i, &t) in bucket.iter().enumerate() {
            assert!(i as f64 + 1.0 <= bound_at(t) + 1e-9, "{i} by {t} ms");
        }
    }

    #[tokio::test]
    async fn the_committed_figure_is_what_this_program_draws() {
        let (window, bucket) = admissions().await.expect("runs");
        let drawn = svg(&window, &bucket).expect("draws");
        let committed = include_str!("../../docs/fixed-window-vs-token-bucket.svg");
        assert!(
            drawn == committed,
            "docs/fixed-window-vs-token-bucket.svg is stale: run \
             `cargo run -p burstgate-tools --bin figure > docs/fixed-window-vs-token-bucket.svg`"
        );
    }
}
