//! Requests, calls and inner services for the tower layer's suites.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burstgate::layer::ResponseBody;
use http::{HeaderName, Request, Response};
use tower::{Service, ServiceExt};

pub(crate) type Req = Request<String>;
pub(crate) type Res = Response<String>;

pub(crate) const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// Waits until `svc` is ready and calls it: the response, since the layer answers a rejection
/// with one, never with an error; its body as text, whether the inner service or the layer
/// wrote it.
pub(crate) async fn call<S>(svc: &mut S, req: Req) -> Res
where
    S: Service<Req, Response = LayerRes>,
    S::Error: std::fmt::Debug,
{
    let res = svc
        .ready()
        .await
        .expect("the service is ready")
        .call(req)
        .await
        .expect("the layer answers with a response");
    text(res)
}

/// What the layer answers over an inner service of `String` bodies.
pub(crate) type LayerRes = Response<ResponseBody<String>>;

/// A layer's response with its body as text, whether the inner service or the layer wrote it.
pub(crate) fn text(res: LayerRes) -> Res {
    res.map(|body| match body.into_inner() {
        Ok(inner) => inner,
        Err(answer) => String::from_utf8(answer.to_vec()).expect("the layer writes UTF-8"),
    })
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
