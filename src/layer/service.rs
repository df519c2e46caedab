use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::config::Config;
use super::decide::{Few, RuleTake, decide};
use super::future::ResponseFuture;
use super::rejection::{self, Protocol};
use super::rule::Plan;
use crate::BucketStore;

/// The service [`RateLimitLayer`](super::RateLimitLayer) wraps around another.
///
/// `Clone` whenever the inner service is, so it works in axum without a `Buffer`.
pub struct RateLimit<S, St> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config<St>>,
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    St: BucketStore + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, St>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the inner service's alone: the limit is decided per request in `call`,
        // so one client over its limit never makes the service unready for the others.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let mut plan = Few::default();
        if let Some(skip) = &self.config.skip
            && skip(&parts)
        {
            let clone = self.inner.clone();
            let inner = mem::replace(&mut self.inner, clone);
            return ResponseFuture::call(inner, Request::from_parts(parts, body), None);
        }
        for (rule, r) in self.config.rules.iter().enumerate() {
            match r.plan(&parts) {
                Plan::Apply(key, cost, limit) => plan.push(RuleTake {
                    rule,
                    key,
                    cost,
                    limit,
                }),
                Plan::Skip => {}
                // Before any store call, so a refused request has taken no tokens. The inner
                // service stays here, ready, for the next request.
                Plan::Refuse(status) => {
                    let protocol = Protocol::of(&parts.method, parts.version, &parts.headers);
                    return ResponseFuture::answer(rejection::missing_key(protocol, status));
                }
            }
        }
        // The clone stays here; the service that was made ready goes with this request.
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        if plan.is_empty() {
            return ResponseFuture::call(inner, Request::from_parts(parts, body), None);
        }
        let decision = Box::pin(decide(Arc::clone(&self.config), plan));
        ResponseFuture::decide(decision, inner, Request::from_parts(parts, body))
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.config.rules)
            .finish_non_exhaustive()
    }
}

impl<S, St> RateLimit<S, St> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, taking the limiter apart.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<St: crate::BucketStore + Clone> RateLimit<(), St> {
    /// The layer that makes this service: [`RateLimitLayer::new`](super::RateLimitLayer::new),
    /// for those who start from the service's name, as tower-http's `layer()` functions allow.
    pub fn layer(store: St) -> super::RateLimitLayer<St> {
        super::RateLimitLayer::new(store)
    }
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}
