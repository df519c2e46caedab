//! `burstgate`: the command-line tool for the operators of an application limited by
//! [burstgate](https://docs.rs/burstgate). It looks at and changes the token buckets the
//! application keeps in Redis (`inspect`, `reset`, `set`, `block`, `unblock`), lists the
//! busiest (`top`) and reads their audit trail (`audit`), naming each bucket as the application
//! does and each key by its fingerprint, never in clear. The README beside this crate lists every
//! option and the fields of `--json`.
//!
//! Every bucket is read and written through the library's own `RedisStore`, with the redis-rs it
//! re-exports, so the command and the application cannot disagree on the stored format.
//!
//! - `args.rs`: the command line;
//! - `connect.rs`: one Redis or a Cluster, and `SCAN` on every primary;
//! - `keys.rs`: keys as the application makes them, secrets and fingerprints, and the layout
//!   of the store's keys;
//! - `audit.rs`: the reader of the audit streams' format;
//! - `commands/`: what each command does and reports;
//! - `span.rs`: durations and times as text;
//! - `error.rs`: what can go wrong.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

mod args;
mod audit;
mod commands;
mod connect;
mod error;
mod keys;
mod span;

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    let json = cli.global.json;
    let done = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(commands::run(cli)),
        Err(e) => {
            eprintln!("error: could not start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout().lock();
    let printed = match done {
        Ok(report) => {
            for note in &report.notes {
                eprintln!("note: {note}");
            }
            let printed = if json {
                writeln!(out, "{}", report.json)
            } else {
                write!(out, "{}", report.text)
            };
            printed.map(|()| ExitCode::SUCCESS)
        }
        Err(e) => {
            if json {
                let doc = serde_json::json!({
                    "error": { "kind": e.kind(), "message": e.to_string() }
                });
                // The document for a program; the message for the person watching it.
                eprintln!("error: {e}");
                writeln!(out, "{doc}").map(|()| ExitCode::FAILURE)
            } else {
                eprintln!("error: {e}");
                Ok(ExitCode::FAILURE)
            }
        }
    };
    // A closed pipe (`| head`) is not worth a panic.
    printed.unwrap_or(ExitCode::FAILURE)
}
