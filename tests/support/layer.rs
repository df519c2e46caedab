//! Requests, calls and inner services for the tower layer's suites.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{HeaderName, Request, Response};
use tower::{Service, ServiceExt};

pub(crate) type Req = Request<String>;
pub(crate) type Res = Response<String>;

pub(crate) const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// Waits until `svc` is ready and calls it: the response, since the layer answers a rejection
/// with one, never with an error.
pub(crate) async fn call<S>(svc: &mut S, req: Req) -> Res
where
    S: Service<Req, Response = Res>,
    S::Error: std::fmt::Debug,
{
    svc.ready()
        .await
        .expect("the service is ready")
        .call(req)
        .await
        .expect("the layer answers with a response")
}

/// An inner service that answers "ok" and counts its calls.
pub(crate) fn counting(
    calls: &Arc<AtomicUsize>,
) -> impl Service<
    Req,
    Response = Res,
    Error = Infallible,
    Future = impl Future<Output = Result<Res, Infallible>> + Send + use<>,
> + Clone
+ Send
+ use<> {
    let calls = Arc::clone(calls);
    tower::service_fn(move |_req: Req| {
        calls.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(String::from("ok"))) }
    })
}
