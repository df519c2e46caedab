//! A job runner with 4 worker slots calling an API limited to "1 per minute, burst 10" per
//! account, for 3 accounts: the slots sleeping in the limiter, against the slots booking turns
//! ([`Ticket`]s) and putting the jobs back on the queue until their time.
//!
//! The job queue holds a backlog of each account's jobs, the first account's first (as a queue
//! filled by one import after another is). A slot that sends through the middleware waits there
//! for its account's turn: with the first account's jobs at the head of the queue, every slot
//! is soon asleep on that one bucket, and the other accounts' budgets go unused. A slot that
//! books the turn instead ([`RateLimitMiddleware::reserve`]) puts the job back on the queue for
//! the ticket's time and takes the next job at once; at its time, the job is sent with its
//! ticket, without taking another token. A job whose turn is further off than the booking
//! ceiling goes back on the queue for the time the local 429 gives.
//!
//! Time is scaled: one minute of the API is 100 ms here, so the run of 6 s stands for an hour.
//! The API is a local axum server that answers each call after 20 ms.
//!
//! ```sh
//! cargo run --example reschedule --features reqwest
//! ```

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use burstgate::middleware::{
    Account, RateLimitMiddleware, Route, Ticket, TicketError, rate_limited,
};
use burstgate::{Limit, MemoryStore};
use http::Extensions;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// Worker slots.
const SLOTS: usize = 4;
const ACCOUNTS: [&str; 3] = ["seller-1", "seller-2", "seller-3"];
/// Jobs waiting for each account: more than an hour's budget.
const BACKLOG: u32 = 200;
/// One minute of the API, here.
const MINUTE: Duration = Duration::from_millis(100);
/// How long the run lasts: an hour of the API.
const RUN: Duration = Duration::from_secs(6);
/// How long the API takes to answer.
const LATENCY: Duration = Duration::from_millis(20);

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/api/v1/supplier/orders", listener.local_addr()?);
    let app = axum::Router::new().fallback(|| async {
        tokio::time::sleep(LATENCY).await;
        "ok"
    });
    tokio::spawn(async move { axum::serve(listener, app).await });

    // "1 per minute, burst 10", with a minute of 100 ms.
    let limit = Limit::new(1, MINUTE)?.with_burst(10)?;
    println!(
        "{SLOTS} slots, {} accounts with {BACKLOG} jobs each, \"1 per minute, burst 10\" per \
         account (a minute is {MINUTE:?} here), for {RUN:?} (an hour)",
        ACCOUNTS.len()
    );
    println!();
    for design in [Design::Sleep, Design::Book] {
        let report = run(design, limit, &url).await?;
        report.print(design);
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Design {
    /// Each slot sends through the middleware, which waits for the account's turn.
    Sleep,
    /// Each slot books the turn, and the job goes back on the queue until it.
    Book,
}

/// A job: one call for one account, with its booked turn once it has one. The ticket is kept as
/// text, as a job queue keeps a payload.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Job {
    account: usize,
    ticket: Option<String>,
}

/// The jobs by the time they are due, then in the order they were queued; a job with a booked
/// turn goes before any other once due, so that its turn is not lost to the backlog.
#[derive(Default)]
struct Queue {
    booked: Mutex<BinaryHeap<Reverse<(Instant, u64, Job)>>>,
    waiting: Mutex<BinaryHeap<Reverse<(Instant, u64, Job)>>>,
    order: AtomicU64,
}

type Heap = BinaryHeap<Reverse<(Instant, u64, Job)>>;

impl Queue {
    fn push(&self, due: Instant, job: Job) {
        let n = self.order.fetch_add(1, Ordering::Relaxed);
        let heap = if job.ticket.is_some() {
            &self.booked
        } else {
            &self.waiting
        };
        lock(heap).push(Reverse((due, n, job)));
    }

    /// The next job due at `now`, booked ones first, or when the earliest one is due.
    fn pop(&self, now: Instant) -> Result<Job, Option<Instant>> {
        let mut earliest = None;
        for heap in [&self.booked, &self.waiting] {
            let mut jobs = lock(heap);
            match jobs.peek() {
                Some(Reverse((due, _, _))) if *due <= now => {
                    return jobs.pop().map(|Reverse((_, _, job))| job).ok_or(None);
                }
                Some(Reverse((due, _, _))) => {
                    earliest = Some(earliest.map_or(*due, |e: Instant| e.min(*due)));
                }
                None => {}
            }
        }
        Err(earliest)
    }
}

fn lock(heap: &Mutex<Heap>) -> std::sync::MutexGuard<'_, Heap> {
    heap.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the slots did over the run.
#[derive(Default)]
struct Report {
    sent: [AtomicU64; ACCOUNTS.len()],
    /// Microseconds the slots spent in the client's calls (the limiter and the API), in the
    /// API's answers alone, and with no job due.
    in_client_us: AtomicU64,
    calling_us: AtomicU64,
    idle_us: AtomicU64,
    /// Turns booked and not yet due at the end, given back.
    given_back: AtomicU64,
}

impl Report {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    fn print(&self, design: Design) {
        let sent: Vec<u64> = self
            .sent
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect();
        let [in_client, calling, idle] = [&self.in_client_us, &self.calling_us, &self.idle_us]
            .map(|c| c.load(Ordering::Relaxed));
        let asleep = in_client.saturating_sub(calling);
        let total = (SLOTS as u64 * RUN.as_micros() as u64).max(1);
        let share = |us: u64| 100.0 * us as f64 / total as f64;
        match design {
            Design::Sleep => println!("Slots sleeping in the limiter:"),
            Design::Book => println!("Slots booking turns and requeueing the jobs:"),
        }
        println!(
            "  calls sent per account: {}, {} in all",
            sent.iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            sent.iter().sum::<u64>()
        );
        println!(
            "  slot time: {:.1}% calling the API, {:.1}% in the limiter (asleep, or booking), \
             {:.1}% free, with no job due",
            share(calling),
            share(asleep),
            share(idle)
        );
        if design == Design::Book {
            println!(
                "  turns booked and not yet due at the end, given back: {}",
                self.given_back.load(Ordering::Relaxed)
            );
        }
        println!();
    }
}

/// Counts the calls that reach the API, and the time they take.
struct Calls(Arc<Report>);

#[async_trait::async_trait]
impl Middleware for Calls {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let start = Instant::now();
        let res = next.run(req, extensions).await;
        Report::add(&self.0.calling_us, start);
        if let Some(AccountIndex(i)) = extensions.get::<AccountIndex>().copied() {
            self.0.sent[i].fetch_add(1, Ordering::Relaxed);
        }
        res
    }
}

/// Which of [`ACCOUNTS`] a call is for, beside its [`Account`].
#[derive(Debug, Clone, Copy)]
struct AccountIndex(usize);

async fn run(design: Design, limit: Limit, url: &str) -> Result<Arc<Report>, Box<dyn Error>> {
    let report = Arc::new(Report::default());
    let limiter = RateLimitMiddleware::new(MemoryStore::new())
        .route(Route::new("orders", limit, "/api/v1/supplier/orders")?)
        // Sleeping, a slot waits as long as its turn takes; booking, a turn up to two minutes
        // off is booked, and a job whose turn is further off is tried again then.
        .max_wait(match design {
            Design::Sleep => RUN * 2,
            Design::Book => MINUTE * 2,
        });
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(limiter.clone())
        .with(Calls(Arc::clone(&report)))
        .build();
    let queue = Arc::new(Queue::default());
    let start = Instant::now();
    for account in 0..ACCOUNTS.len() {
        for _ in 0..BACKLOG {
            queue.push(
                start,
                Job {
                    account,
                    ticket: None,
                },
            );
        }
    }
    let deadline = start + RUN;
    let slots: Vec<_> = (0..SLOTS)
        .map(|_| {
            let slot = Slot {
                design,
                limiter: limiter.clone(),
                client: client.clone(),
                url: url.to_owned(),
                queue: Arc::clone(&queue),
                report: Arc::clone(&report),
            };
            tokio::spawn(slot.run(deadline))
        })
        .collect();
    for slot in slots {
        slot.await??;
    }
    // The turns booked and not sent go back, as the sleeping slots' do when their calls are
    // dropped at the end.
    while let Ok(job) = queue.pop(Instant::now() + RUN) {
        if let Some(ticket) = job.ticket {
            let ticket: Ticket = ticket
                .parse()
                .map_err(reqwest_middleware::Error::middleware)?;
            if limiter.cancel(&ticket).await? {
                report.given_back.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(report)
}

struct Slot {
    design: Design,
    limiter: RateLimitMiddleware<MemoryStore>,
    client: ClientWithMiddleware,
    url: String,
    queue: Arc<Queue>,
    report: Arc<Report>,
}

impl Slot {
    async fn run(self, deadline: Instant) -> Result<(), reqwest_middleware::Error> {
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            let job = match self.queue.pop(now) {
                Ok(job) => job,
                Err(due) => {
                    let until = due.unwrap_or(deadline).min(deadline);
                    tokio::time::sleep_until(until).await;
                    Report::add(&self.report.idle_us, now);
                    continue;
                }
            };
            match self.design {
                Design::Sleep => self.sleep_on(job, deadline).await?,
                Design::Book => self.book(job).await?,
            }
        }
    }

    fn request(&self, job: &Job) -> reqwest_middleware::RequestBuilder {
        self.client
            .get(&self.url)
            .with_extension(Account::new(ACCOUNTS[job.account]))
            .with_extension(AccountIndex(job.account))
    }

    /// Sends through the middleware, asleep in the slot until the account's turn.
    async fn sleep_on(&self, job: Job, deadline: Instant) -> Result<(), reqwest_middleware::Error> {
        let start = Instant::now();
        let sent = tokio::select! {
            sent = self.request(&job).send() => sent.map(drop),
            // A slot still asleep at the end gives its turn back as the call is dropped.
            () = tokio::time::sleep_until(deadline) => Ok(()),
        };
        Report::add(&self.report.in_client_us, start);
        sent
    }

    /// Sends a job whose turn has come with its ticket; otherwise books the turn, and puts the
    /// job back on the queue until then.
    async fn book(&self, mut job: Job) -> Result<(), reqwest_middleware::Error> {
        let start = Instant::now();
        if let Some(text) = job.ticket.take() {
            let ticket: Ticket = text
                .parse()
                .map_err(reqwest_middleware::Error::middleware)?;
            let early = ticket.ready_in(SystemTime::now());
            let sent = self.request(&job).with_extension(ticket).send().await;
            Report::add(&self.report.in_client_us, start);
            return match sent {
                Ok(_) => Ok(()),
                // Sent a little early (the queue's clock and the system's drift apart): the
                // ticket still stands, and the job goes back with it.
                Err(e) if rate_limited(&e).is_some() && !early.is_zero() => {
                    job.ticket = Some(text);
                    self.queue.push(Instant::now() + early, job);
                    Ok(())
                }
                // An upstream back-off passed the turn, or the ticket came too late: booked
                // again.
                Err(e) => self.again(job, &e),
            };
        }
        let request = self.request(&job).build()?;
        let mut extensions = Extensions::new();
        extensions.insert(Account::new(ACCOUNTS[job.account]));
        let booked = self.limiter.reserve(&request, &extensions).await;
        Report::add(&self.report.in_client_us, start);
        match booked {
            Ok(Some(ticket)) => {
                let due = Instant::now() + ticket.ready_in(SystemTime::now());
                job.ticket = Some(ticket.to_string());
                self.queue.push(due, job);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => self.again(job, &e),
        }
    }

    /// Puts a job the limiter refused back on the queue for the time it gave.
    fn again(
        &self,
        job: Job,
        e: &reqwest_middleware::Error,
    ) -> Result<(), reqwest_middleware::Error> {
        // A ticket sent past its grace (every slot was busy when it came due): its tokens are
        // spent, and the job books again at once.
        if let reqwest_middleware::Error::Middleware(inner) = e
            && inner.downcast_ref::<TicketError>() == Some(&TicketError::Expired)
        {
            self.queue.push(Instant::now(), job);
            return Ok(());
        }
        let Some(limited) = rate_limited(e) else {
            return Err(reqwest_middleware::Error::middleware(
                std::io::Error::other(e.to_string()),
            ));
        };
        self.queue.push(Instant::now() + limited.retry_after(), job);
        Ok(())
    }
}
